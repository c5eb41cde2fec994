"""What the benchmarks share: a run's JSON header (run_info), summary statistics (stats),
the case-by-case loop of the GPU benchmarks (case_runs), the host-cost benchmarks' command
line and report (host_cost) and the head configurations they run (heads). Scripts run from
benchmarks/ import it as `common`."""
