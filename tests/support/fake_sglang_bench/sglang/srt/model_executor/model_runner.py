"""load_model's runner, faked: a model whose weights each process draws at random (as the dummy
load format does) and whose logits come back as views of one buffer that every step overwrites
(as SGLang's graphs return them). Apart from one_batch, so that a latency run imports no torch
(its process starts in a fraction of the time)."""

import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, 16)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(16))
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        with torch.no_grad():  # the dummy load format: small random values, drawn in each process
            for p in self.parameters():
                p.uniform_(-1e-3, 1e-3)


class Runner:
    def __init__(self, backend):
        self.backend = backend
        self.torch_runner = type("ModelRunner", (), {})()
        self.torch_runner.model = Model()
        self.buffer = torch.empty(4, 64)

    def _logits(self, ids, step):
        model = self.torch_runner.model
        hidden = model.embed_tokens(ids % 64) * model.norm.weight + step
        if self.backend == "broken":
            hidden = hidden + torch.randn(hidden.shape)  # a wrong attention output
        with torch.no_grad():
            self.buffer[: len(ids)] = model.lm_head(hidden)
        return self.buffer[: len(ids)]

    def extend(self, reqs):
        ids = torch.tensor([r[-1] for r in reqs])
        return ids, self._logits(ids, 0), len(reqs)

    def decode(self, ids, batch):
        return ids, self._logits(ids, 1 + int(ids[0]) % 7)
