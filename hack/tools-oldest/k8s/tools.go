//go:build tools

// Keeps kube-apiserver's dependencies in go.mod/go.sum for `go mod tidy`.
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
