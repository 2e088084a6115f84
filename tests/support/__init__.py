"""Test doubles and stand-ins for the weight-sync tests and benchmarks (not part of the library).

    receiver.WeightReceiver        a receiver without vLLM: a transformers model that answers the
                                   four weight-transfer calls (`python -m tests.support.receiver`)
    channel_client.ChannelClient   the trainer's client for such receivers (over the TCPStore)
    faults.faulty(cls)             a transport class with test-side fault injection
Importable from tests/ (pytest puts the repository root on sys.path) and from bench/ (the
scripts put it there themselves).
"""
