"""The engines that train a round's participants and drive runs: sequential and vectorized clients, stacks of
runs, the step graph, the learning-rate schedule, the transport to the round driver, checkpoints."""
