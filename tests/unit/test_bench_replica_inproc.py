"""bench.replica_inproc: the request it sends is a valid binary request of every input of the model."""

from bench import replica_inproc
from deployments.protocol.binary import decode_body


def test_the_body_decodes_to_every_input_of_the_model_at_batch_1(model_repository):
    for name, shapes in (("simple", {"INPUT0": (1, 16), "INPUT1": (1, 16)}), ("tiny_cnn", {"input": (1, 3, 224, 224)})):
        body, head_bytes = replica_inproc.body_of(model_repository.get(name).config)
        request = decode_body([body], str(head_bytes))
        assert {n: a.shape for n, a in request.inputs.items()} == shapes
        assert len(body) == head_bytes + sum(a.nbytes for a in request.inputs.values())
