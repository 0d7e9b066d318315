"""The dflash family's studies: benchmarks, planner workloads and projections."""
