// A tiny static pause process for pod sandboxes, so no image has to be pulled.
module sealedvolumes.io/hack/tools/pause

go 1.24.0
