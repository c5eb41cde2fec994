REGISTERED: dict = {}


def register_attention_backend(name):
    def record(factory):
        REGISTERED[name] = factory
        return factory
    return record
