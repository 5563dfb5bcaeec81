"""A Flower ``Grid`` that hands each message straight to ClientApp handlers, one ``Context`` per node:
the ServerApp's logic, the wire format and the nodes' state handling without the simulation engine's
start-up (about 30 s a run), so that every registered method can be checked quickly.  ``tamper(node,
reply) -> reply`` edits a node's reply on its way back (hostile nodes)."""

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedpm_flower import apps


class AppGrid:
    """Node ``first_node`` + i runs ``handlers[message type](msg, context)`` (``handlers["*"]`` for the other
    types) with ``node_configs[i]`` and ``run_config``."""

    def __init__(
        self, handlers: dict, node_configs: list, run_config: dict | None = None, tamper=None, first_node: int = 100
    ):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
        self.handlers, self.tamper = handlers, tamper
        self.contexts = {
            first_node + i: Context(
                run_id=1, node_id=first_node + i, node_config=nc, state=RecordDict(), run_config=run_config or {}
            )
            for i, nc in enumerate(node_configs)
        }

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            handler = self.handlers.get(m.metadata.message_type) or self.handlers["*"]
            try:
                reply = handler(m, self.contexts[m.metadata.dst_node_id])
            except Exception as exc:  # what a SuperNode sends back when the ClientApp raises
                reply = Message(Error(code=0, reason=str(exc)), reply_to=m)
            if self.tamper is not None:
                reply = self.tamper(m.metadata.dst_node_id, reply)
            if reply is not None:
                out.append(reply)
        return out


class LoopbackGrid(AppGrid):
    """Our own ClientApp (``fedpm_flower.apps``) for the run configuration ``cfg``."""

    def __init__(self, cfg, nodes=None, tamper=None):
        parts = range(cfg.clients) if nodes is None else nodes  # node i holds partition parts[i]
        train = lambda m, c: apps.train(m, c, cfg)  # noqa: E731
        query = lambda m, c: apps.query(m, c, cfg)  # noqa: E731
        super().__init__({"train": train, "*": query}, [{"partition-id": p} for p in parts], tamper=tamper)
        self.cfg = cfg
