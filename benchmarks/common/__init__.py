"""What the benchmarks share: starting the ranks and the shaped link (:mod:`.launch`), the
models (:mod:`.models`, :mod:`.llama`, the SimpleFSDP-style peer in :mod:`.simple_fsdp`), the
bounds a step is held against (:mod:`.achievable`), step timelines (:mod:`.step_timeline`) and
the results' tables, JSON and plots (:mod:`.results`)."""
