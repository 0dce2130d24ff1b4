"""Detection: the cost model, the schedule DAG, the frame of one iteration, its scoring, the judges
that read it, the incident book they report to, the fail-stop watch and the baselines."""
