"""Process orchestration for dKV: node processes, etcd, local clusters."""
