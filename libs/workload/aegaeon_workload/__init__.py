"""What a benchmark or the simulator sends and records: synthetic arrivals and lengths, class mixes
and bursts, the plan of a run, its trace files. Below both bench and sim."""
