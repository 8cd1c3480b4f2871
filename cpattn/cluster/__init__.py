"""Ray side of cpattn: shard worker actors, the coordinator actor, the torch.distributed data plane,
placement and rank assignment."""
