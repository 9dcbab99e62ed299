"""The training engines a rank runs a plan in: DeepSpeed's pipeline engine driven by pipectl's
schedule, DeepSpeed's plain engine, torch's pipelining runtime; their config and process groups."""
