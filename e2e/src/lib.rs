//! Helpers that start or reuse the local cluster from `hack/cluster.sh`.
