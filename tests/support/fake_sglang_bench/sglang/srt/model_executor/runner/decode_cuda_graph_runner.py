"""SGLang's decode graph runner, faked: the two steps of a replay that sglang_e2e.py's
--step-timing wraps, execute calling load_batch (the host step) and then the replay."""


class DecodeCudaGraphRunner:
    def __init__(self):
        self.loaded = []

    def load_batch(self, forward_batch, pp_proxy_tensors=None):
        self.loaded.append(forward_batch.batch_size)

    def execute(self, forward_batch, pp_proxy_tensors=None):
        self.load_batch(forward_batch, pp_proxy_tensors)
        return None
