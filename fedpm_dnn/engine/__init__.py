"""How clients train and runs are driven: the sequential engine and the client data it reads (``sequential``), the
vectorized engine (``vectorized``) with its model over stacked parameters (``stacked_model``) and its step as a CUDA
graph (``step_graph``), the round's training task that picks the engine (``training_task``), the transport to the
round driver (``transport``), the in-process front-end (``simulation``), several runs trained as one stack
(``stacked_runs``), the learning-rate schedule (``lr_schedule``) and checkpoints (``checkpoint``).

The engines call the methods (``fedpm_dnn.algorithms``) and the preconditioner (``fedpm_dnn.foof``); neither
imports an engine (docs/architecture.md, "fedpm_dnn's layers")."""
