"""The shared data layer: opening data files (:mod:`.files`), WordPiece tokenizers (:mod:`.tokenize`), corpora
of source code read and split (:mod:`.sources`) and the local BPE tokenizer (:mod:`.bpe`). A workload's own
data lives in its folder, :mod:`comera.workloads`."""
