"""What the bench and the simulator send and record: arrivals, mixes, plans, traces."""
