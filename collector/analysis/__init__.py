"""Analysis: the engine that judges each committed step, the analyzers it runs, the thread that runs it
in the store's writer, and the findings they leave in the store, published to the consumers the server
registers (collector/findings.py): it imports none of them."""
