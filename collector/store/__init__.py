"""The store: the DuckDB file and the one writer process that fills it, from the bottom up.

  schema.py    the DDL: the one definition of every table
  db.py        opening a store file, its tables, and who holds its lock (imports nothing else of the collector)
  requests.py  the typed requests the writer answers, and the registry of their handlers
  writer.py    the writer process: group commit, calls answered between commits, the tasks it runs
  handle.py    the server's handle on the writer: admission, futures, a new writer when one dies

Import the module you need: this package imports none of them, so that opening a file (db.py)
costs no more than DuckDB.
"""
