"""A Flower ``Grid`` that hands each message straight to our ClientApp handlers, one ``Context`` per node:
the ServerApp's logic, the wire format and the nodes' state handling without the simulation engine's
start-up (about 30 s a run), so that every registered method can be checked quickly.  ``tamper(node,
reply) -> reply`` edits a node's reply on its way back (hostile nodes)."""

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedpm_flower import apps


class LoopbackGrid:
    def __init__(self, cfg, nodes=None, tamper=None):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
        self.cfg, self.tamper = cfg, tamper
        parts = range(cfg.clients) if nodes is None else nodes  # node i holds partition parts[i]
        self.contexts = {
            100 + i: Context(
                run_id=1, node_id=100 + i, node_config={"partition-id": p}, state=RecordDict(), run_config={}
            )
            for i, p in enumerate(parts)
        }

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, msgs, timeout=None):
        out = []
        for m in msgs:
            handler = apps.train if m.metadata.message_type == "train" else apps.query
            try:
                reply = handler(m, self.contexts[m.metadata.dst_node_id], self.cfg)
            except Exception as exc:  # what a SuperNode sends back when the ClientApp raises
                reply = Message(Error(code=0, reason=str(exc)), reply_to=m)
            if self.tamper is not None:
                reply = self.tamper(m.metadata.dst_node_id, reply)
            if reply is not None:
                out.append(reply)
        return out
