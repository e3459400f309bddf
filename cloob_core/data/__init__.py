"""Data stages: manifest → download/filter → WebDataset shards → validation gate, and the training reader.

The split follows img2dataset's: a reader (``manifest``), a downloader (``fetch``), a resizer (``imaging``) and
a writer (``shards``), driven by ``download``; ``validate`` is the gate and ``loader`` reads the shards back.
"""
