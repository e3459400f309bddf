"""Data stages: manifest → download/filter → WebDataset shards → validation gate.

The split follows img2dataset's: a reader (``manifest``), a downloader (``fetch``), a resizer (``imaging``) and
a writer (``writer``), driven by ``download``; ``sources`` are where rows' bytes come from besides http(s),
``validate`` is the gate, and ``shard_files`` finds and opens a shards folder for its readers.
"""
