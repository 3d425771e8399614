"""The wire library every process links: messages and their bytes (`messages`), what a field may hold
(`fields`), the run's limits on a message's content (`limits`), the ZeroMQ clients (`client`), CURVE keys
(`curve`) and addresses (`addresses`). The broker is a service on top of it; nothing here imports a part of
the system above the config."""
