"""The pass framework, apart from the passes (one module each in :mod:`passes`):

- running them: :mod:`.pipeline` (``Pipeline``, ``default_pipeline``), :mod:`.registration`
  (``install``), :mod:`.interface` (each pass's declaration), :mod:`.cache_key`, :mod:`.verify`
  (the rewrite checker), :mod:`.graph_text` (graphs as text);
- what the passes share, each module one job: :mod:`.ops` (the ops they look for), :mod:`.marks`
  (which nodes they may touch), :mod:`.chains` (a comm hook's chain around a collective),
  :mod:`.record` (what they decided), :mod:`.traversal` (aliases and dependencies),
  :mod:`.groups` (process groups, all-to-all pieces), :mod:`.values` (new nodes' fake values),
  :mod:`.bucket` and :mod:`.weight_update` (what bucketing and ZeRO's passes share).
"""
