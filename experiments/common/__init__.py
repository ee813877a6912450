"""What the studies and benchmarks share: ``results`` (where results go, run metadata, result files, run
names), ``launch`` (spawning gloo ranks, allocator settings), ``timing`` (alternating timed calls),
``memory`` (peak RSS and allocator peaks), ``peers`` (other libraries' attention, wrapped), ``generated``
(the README blocks rendered from results files)."""
