"""Chaos: drive real elastic_ddp jobs from the outside (processes, signals, etcd, storage) and
prove that recovery loses nothing."""
