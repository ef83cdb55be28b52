"""The inputs `hsx extract` and `hsx regenerate` read, as rows: `open_source(spec)` gives
(name, iterator of (n, row, error)) for a JSON / JSON Lines file, a local Hugging Face dataset
directory or `hf:org/name[:split]` (the spec's forms: hsx_client.corpus.inputs). A row that
cannot be decoded is yielded with its error, so it costs that row only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsx_client.corpus import images


class _RowError(str):
    """An error text for a row, with its BadRow kind."""

    kind = "invalid_json"


def _row_error(text: str, kind: str) -> _RowError:
    e = _RowError(text)
    e.kind = kind
    return e


def _iter_json_file(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (n, row, error) for a .json or .jsonl file. A line that is not UTF-8 costs
    that line only (JSON Lines); a .json array must decode as a whole."""
    data = path.read_bytes()
    if path.suffix.lower() == ".json":
        try:
            text = data.decode("utf-8")
            rows_or_err: Any = json.loads(text)
        except UnicodeDecodeError as exc:
            rows_or_err = exc
        except json.JSONDecodeError as exc:
            rows_or_err = exc
        if isinstance(rows_or_err, UnicodeDecodeError):
            if b"\n{" not in data:  # one JSON document: it cannot be split into rows
                yield 1, None, _row_error(f"file is not UTF-8 (byte {rows_or_err.start})", "not_utf8")
                return
        elif isinstance(rows_or_err, json.JSONDecodeError):
            if rows_or_err.msg != "Extra data":  # not JSON Lines either
                yield 1, None, _row_error(f"file is not valid JSON: {rows_or_err}", "invalid_json")
                return
        else:
            rows = rows_or_err if isinstance(rows_or_err, list) else [rows_or_err]
            for i, row in enumerate(rows, 1):
                yield i, row, None
            return
    for i, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield i, None, _row_error(f"line is not UTF-8 (byte {exc.start} of the line)", "not_utf8")
            continue
        try:
            yield i, json.loads(line), None
        except json.JSONDecodeError as exc:
            yield i, None, _row_error(f"invalid JSON line: {exc.msg} at column {exc.colno}", "invalid_json")


def _pick_split(ds: Any, where: str, split: str | None) -> Any:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split is not None:
            if split not in ds:
                raise ValueError(f"{where}: no split {split!r} (splits: {sorted(ds)})")
            return ds[split]
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise ValueError(f"{where}: several splits {sorted(ds)} and none is 'train'")
    return ds


def _iter_hf(ds: Any) -> Iterator[tuple[int, Any, str | None]]:
    if hasattr(ds, "with_format"):
        ds = ds.with_format(None)  # plain python values, even for torch-formatted sets
    ds = images.undecoded(ds)
    for i, row in enumerate(ds, 1):
        yield i, row, None


def open_source(spec: str) -> tuple[str, Iterator[tuple[int, Any, str | None]]]:
    """Return (name, row iterator) for one input spec; missing inputs raise."""
    if spec.startswith("hf:"):
        rest = spec[3:]
        name, _, split = rest.partition(":")
        if not name:
            raise ValueError(f"empty hub dataset id in {spec!r}")
        import datasets

        try:
            ds = datasets.load_dataset(name, split=split or "train")
        except Exception as exc:  # network, auth, unknown id ...
            raise RuntimeError(
                f"cannot load Hugging Face hub dataset {name!r} (split {split or 'train'!r}): "
                f"{type(exc).__name__}: {exc}. If the hub is not reachable from here, download "
                f"the dataset elsewhere, `save_to_disk` it and pass the directory."
            ) from exc
        return spec, _iter_hf(ds)

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {spec}")
    if path.is_dir():
        import datasets

        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(path))
        else:
            try:
                ds = datasets.load_dataset(str(path))
            except Exception as exc:
                raise ValueError(
                    f"{spec}: directory is neither a `save_to_disk` dataset nor loadable by "
                    f"`datasets.load_dataset`: {type(exc).__name__}: {exc}"
                ) from exc
        return path.name, _iter_hf(_pick_split(ds, spec, None))
    return path.name, _iter_json_file(path)
