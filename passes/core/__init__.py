"""What the passes share, apart from the passes (one module each in :mod:`passes`, composed by
:mod:`passes.pipeline` and installed by :mod:`passes.registration`):

- :mod:`.interface` (each pass's declaration), :mod:`.cache_key` (the FX graph cache's key),
  :mod:`.verify` (the rewrite checker), :mod:`.graph_text` (graphs as text);
- the helpers, one job a module: :mod:`.ops` (the ops the passes look for), :mod:`.marks`
  (which nodes they may touch), :mod:`.chains` (a comm hook's chain around a collective),
  :mod:`.record` (what they decided), :mod:`.traversal` (aliases and dependencies),
  :mod:`.groups` (process groups, all-to-all pieces), :mod:`.values` (new nodes' fake values),
  :mod:`.bucket` and :mod:`.weight_update` (what bucketing and ZeRO's passes share).
"""
