"""`hsx regenerate`: a chat corpus's assistant turns generated again by the target itself.

conversations.py reads the inputs `hsx extract` reads into conversations; turns.py
regenerates one conversation turn by turn; journal.py makes the run crash-safe (a plan,
a journal of finished conversations, the output written atomically at the end); run.py
drives it over HsxClient's servers; cli.py is the command line. The output is a chat
JSONL whose rows carry `hsx_turns` (each regenerated turn's prompt and generated token
ids), which `hsx extract` reads token-exactly (hsx_client.corpus.inputs).
"""
