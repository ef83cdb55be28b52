"""hsx_tools: what sits above both sides: the `hsx` command (cli), the demo, `hsx bench`, the
tiny-model makers and the `hsx serve` process helper. It may import hsx_service and hsx_client;
neither side nor the kernel (hsx) imports it."""
