#!/usr/bin/env bash
# A real single-node Kubernetes for tests, with no Docker and no systemd.
#
#   hack/cluster.sh up [--control-plane-only]   start (or reuse) the cluster; waits until healthy
#   hack/cluster.sh up --nodes N [--label NODE:KEY=VALUE]...
#                                               and N-1 more nodes sealed-node-2..N on the same
#                                               control plane (tainted and labelled
#                                               sealedvolumes.io/fleet=true; docs/cluster.md)
#   hack/cluster.sh down                        stop everything it started and remove its state
#   hack/cluster.sh down --extra-nodes          remove only sealed-node-2..N (and their pods)
#   hack/cluster.sh status                      show processes and nodes; exit 1 if not healthy
#   hack/cluster.sh kubeconfig                  print the admin kubeconfig path
#
# Control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback
# (the API server listens on all addresses so pods can reach it through the node bridge).
# Node: kubelet + kube-proxy driving Debian's containerd, runc and CNI bridge plugin.
# Binaries come from hack/build-k8s.sh (cached); images from hack/images.sh.
#
# Env: SEALED_CLUSTER_DIR (state, default /var/lib/sealed-cluster), SEALED_KUBELET_DIR
# (default /var/lib/kubelet, where CSI drivers expect it), SEALED_NODE_NAME (sealed-node),
# SEALED_REGISTRY (127.0.0.1:15000: the loopback registry containerd pulls from over plain
# http, with the pod's imagePullSecret; e2e/tests/journey.rs serves it with crane behind
# hack/registry-auth.py).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

DIR="${SEALED_CLUSTER_DIR:-/var/lib/sealed-cluster}"
KUBELET_DIR="${SEALED_KUBELET_DIR:-/var/lib/kubelet}"
NODE_NAME="${SEALED_NODE_NAME:-sealed-node}"
PKI="$DIR/pki"
RUN="$DIR/run"
LOGS="$DIR/logs"
KUBECONFIG_ADMIN="$DIR/admin.kubeconfig"
CONTAINERD_SOCK="$RUN/containerd.sock"
REGISTRY="${SEALED_REGISTRY:-127.0.0.1:15000}"

# One bridge, one /24 for pods. The node's address lives on that bridge, so the
# kubelet, the API server's advertised endpoint and the pods never leave this machine.
BRIDGE=sealed0
POD_CIDR=10.244.0.0/24
NODE_IP=10.244.0.1
SERVICE_CIDR=10.96.0.0/16
SERVICE_IP=10.96.0.1
ETCD_PORT=12379 # not 2379, so a developer's own etcd is left alone
APISERVER_PORT=6443
API_URL="https://127.0.0.1:$APISERVER_PORT"

CONTROL_PLANE=(etcd kube-apiserver kube-controller-manager kube-scheduler)
NODE_COMPONENTS=(containerd kubelet kube-proxy)

usage() { usage_from_header "${BASH_SOURCE[0]}"; }

# --- processes -------------------------------------------------------------

pid_of() { [[ -f $RUN/$1.pid ]] && cat "$RUN/$1.pid"; }
is_running() {
  local pid
  pid=$(pid_of "$1") || return 1
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
  # A killed process is a zombie until init reaps it; that is not running.
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

# start NAME CMD...: runs CMD in its own session, logs to $LOGS/NAME.log, records the pid.
start() {
  local name=$1
  shift
  is_running "$name" && { log "$name already running (pid $(pid_of "$name"))"; return 0; }
  log "starting $name"
  # fd 9 is our lock: a daemon must not inherit it, or the next `up` would wait for it.
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$RUN/$name.pid"
  sleep 0.2
  is_running "$name" || die "$name exited at once; see $LOGS/$name.log:
$(tail -n 20 "$LOGS/$name.log")"
}

# stop NAME...: SIGTERM to each, SIGKILL to any still there after 10 s. Only the
# recorded pids are signalled, all at once so teardown takes seconds, not minutes.
stop() {
  local name pid alive pids=()
  for name in "$@"; do
    pid=$(pid_of "$name") || continue
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
      log "stopping $name (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for name in "$@"; do rm -f "$RUN/$name.pid"; done
}

# --- certificates and kubeconfigs ------------------------------------------

gen_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

gen_ca() {
  gen_key "$PKI/ca.key"
  openssl req -x509 -new -key "$PKI/ca.key" -days 3650 -subj "/CN=sealed-cluster-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$PKI/ca.crt" 2>/dev/null
}

# issue NAME SUBJECT EXT_KEY_USAGE [SANS]: a leaf certificate signed by the cluster CA.
issue() {
  local name=$1 subject=$2 eku=$3 sans=${4:-}
  gen_key "$PKI/$name.key"
  openssl req -new -key "$PKI/$name.key" -subj "$subject" -out "$PKI/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $sans ]] && echo "subjectAltName=$sans"
  } >"$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

gen_pki() {
  [[ -f $PKI/done ]] && return 0
  log "generating certificates in $PKI"
  mkdir -p "$PKI"
  chmod 700 "$PKI"
  gen_ca
  issue kube-apiserver "/CN=kube-apiserver" serverAuth \
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:$SERVICE_IP,IP:$NODE_IP"
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
  issue admin "/O=system:masters/CN=sealed-admin" clientAuth
  issue kube-controller-manager "/CN=system:kube-controller-manager" clientAuth
  issue kube-scheduler "/CN=system:kube-scheduler" clientAuth
  issue kube-proxy "/CN=system:kube-proxy" clientAuth
  issue kubelet-client "/O=system:nodes/CN=system:node:$NODE_NAME" clientAuth
  issue kubelet-server "/CN=$NODE_NAME" serverAuth "DNS:$NODE_NAME,DNS:localhost,IP:$NODE_IP,IP:127.0.0.1"
  gen_key "$PKI/sa.key"
  openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
  touch "$PKI/done"
}

# kubeconfig FILE CERT_NAME: a kubeconfig with the credentials embedded, so it can be copied.
kubeconfig() {
  local file=$1 cert=$2
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sealed
  cluster:
    server: $API_URL
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $cert
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$cert.crt")
    client-key-data: $(base64 -w0 "$PKI/$cert.key")
contexts:
- name: sealed
  context: {cluster: sealed, user: $cert}
current-context: sealed
EOF
  chmod 600 "$file"
}

gen_kubeconfigs() {
  kubeconfig "$KUBECONFIG_ADMIN" admin
  local c
  for c in kube-controller-manager kube-scheduler kube-proxy kubelet-client; do
    kubeconfig "$DIR/$c.kubeconfig" "$c"
  done
}

# --- control plane ---------------------------------------------------------

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

start_control_plane() {
  start etcd "$BIN/etcd" --name sealed --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster sealed=http://127.0.0.1:12380 --listen-metrics-urls http://127.0.0.1:12381 \
    --quota-backend-bytes 2147483648 --log-level warn
  wait_for etcd 60 curl -fsS "http://127.0.0.1:$ETCD_PORT/health" || die "etcd did not become healthy; see $LOGS/etcd.log"

  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 0.0.0.0 --secure-port "$APISERVER_PORT" --advertise-address "$NODE_IP" \
    --tls-cert-file "$PKI/kube-apiserver.crt" --tls-private-key-file "$PKI/kube-apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$PKI/ca.crt" --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --allow-privileged=true --profiling=false --v=1
  wait_for kube-apiserver 180 kubectl_admin get --raw /readyz ||
    die "kube-apiserver did not become ready; see $LOGS/kube-apiserver.log"

  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$DIR/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/kube-controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --root-ca-file "$PKI/ca.crt" --service-account-private-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --allocate-node-cidrs=false --v=1
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig "$DIR/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/kube-scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false --v=1

  # Pods cannot be created before the default ServiceAccount and root CA ConfigMap exist.
  wait_for "default ServiceAccount" 120 kubectl_admin -n default get serviceaccount default ||
    die "no default ServiceAccount; see $LOGS/kube-controller-manager.log"
  wait_for "kube-root-ca.crt" 60 kubectl_admin -n default get configmap kube-root-ca.crt ||
    die "no kube-root-ca.crt ConfigMap; see $LOGS/kube-controller-manager.log"
}

# --- node ------------------------------------------------------------------

setup_host() {
  # Bidirectional mount propagation (the CSI plugin's mounts) needs a shared root.
  mount --make-rshared /
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$NODE_IP/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  block_pod_egress
  mkdir -p "$DIR/cni/net.d" "$KUBELET_DIR" "$DIR/pod-logs"
  # The bridge already has the gateway address, so the plugin need not be the gateway:
  # as one it would also turn on IP forwarding. No masquerading either.
  cat >"$DIR/cni/net.d/10-sealed.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "sealed",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": false, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$DIR/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

# Pods may reach the node and each other, never anything off this machine, even where
# IP forwarding is on for other reasons.
EGRESS_RULE=(FORWARD -i "$BRIDGE" ! -o "$BRIDGE" -m comment --comment "sealed-cluster: pods stay on this machine" -j DROP)
block_pod_egress() {
  iptables -w -C "${EGRESS_RULE[@]}" 2>/dev/null || iptables -w -I "${EGRESS_RULE[@]}"
}
unblock_pod_egress() {
  while iptables -w -C "${EGRESS_RULE[@]}" 2>/dev/null; do iptables -w -D "${EGRESS_RULE[@]}"; done
}

# containerd's hosts directory (config_path): the test registry is plain http on loopback.
# containerd reads it at every pull, so the registry may start after the cluster.
write_registry_hosts() {
  local d="$DIR/containerd/certs.d/$REGISTRY"
  mkdir -p "$d"
  cat >"$d/hosts.toml" <<EOF
server = "http://$REGISTRY"

[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
}

start_containerd() {
  mkdir -p "$DIR/containerd"
  write_registry_hosts
  cat >"$DIR/containerd/config.toml" <<EOF
version = 2
root = "$DIR/containerd/root"
state = "$DIR/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$DIR/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This sandbox has no CAP_SYS_RESOURCE, so no process may lower its oom_score_adj
  # (the pause container's -998 would make runc fail): clamp to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$DIR/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DIR/cni/net.d"
  # Registry hosts (hosts.toml per host); credentials come from the pod's imagePullSecrets.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$DIR/containerd/certs.d"
EOF
  start containerd /usr/bin/containerd --config "$DIR/containerd/config.toml"
  wait_for containerd 60 ctr --address "$CONTAINERD_SOCK" version || die "containerd did not start; see $LOGS/containerd.log"
}

start_node() {
  setup_host
  start_containerd
  log "importing base images"
  SEALED_CLUSTER_DIR="$DIR" "$HACK_DIR/images.sh" base >/dev/null

  cat >"$DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $PKI/kubelet-server.crt
tlsPrivateKeyFile: $PKI/kubelet-server.key
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
# This machine has cgroup v1, no systemd and no swap policy.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
podCIDR: $POD_CIDR
podLogsDir: $DIR/pod-logs
# Shared build machines: never evict test pods or GC our imported images for disk pressure.
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOF
  start kubelet "$BIN/kubelet" --config "$DIR/kubelet-config.yaml" \
    --kubeconfig "$DIR/kubelet-client.kubeconfig" --root-dir "$KUBELET_DIR" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --v=1

  cat >"$DIR/kube-proxy-config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $DIR/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $NODE_NAME
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["$NODE_IP/32"]
conntrack: {maxPerCore: 0}
EOF
  start kube-proxy "$BIN/kube-proxy" --config "$DIR/kube-proxy-config.yaml"

  wait_for "node $NODE_NAME to register" 120 kubectl_admin get node "$NODE_NAME" ||
    die "the kubelet did not register; see $LOGS/kubelet.log"
  kubectl_admin wait --for=condition=Ready "node/$NODE_NAME" --timeout=180s >/dev/null ||
    die "node $NODE_NAME is not Ready; see $LOGS/kubelet.log and $LOGS/containerd.log"
  # Until kube-proxy's first sync, pods cannot reach the API server's Service.
  wait_for "kube-proxy to program the kubernetes Service" 60 service_programmed ||
    die "kube-proxy did not program Services; see $LOGS/kube-proxy.log"
}

service_programmed() { iptables -w -t nat -S KUBE-SERVICES 2>/dev/null | grep -q 'default/kubernetes:https'; }

# --- teardown --------------------------------------------------------------

# Kills every container our containerd runs, then the shims that outlive containerd.
stop_containers() {
  if is_running containerd; then
    local t
    for t in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
    sleep 1
  fi
  stop containerd
  # Shims re-parent to init; ours are the ones whose command line names our socket.
  local p
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -q -- "-address $CONTAINERD_SOCK "; then
      kill -KILL "${p#/proc/}" 2>/dev/null || true
    fi
  done
}

unmount_under() {
  local prefix=$1 m
  # Deepest first; lazy only if a normal unmount fails.
  { findmnt -rn -o TARGET | grep -E "^${prefix}(/|$)" || true; } | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
}

cleanup_network() {
  local ns
  # Pod network namespaces that containerd's CNI setup pinned under /run/netns.
  for ns in /run/netns/cni-*; do
    [[ -e $ns ]] || continue
    umount "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
  local veth
  for veth in $(ip -o link show master "$BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    ip link del "$veth" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  command -v iptables >/dev/null && unblock_pod_egress
  # Remove the kubelet's and kube-proxy's KUBE-* chains and rules, leave all else as it was.
  local save restore
  for save in iptables-save ip6tables-save; do
    restore=${save/-save/-restore}
    command -v "$save" >/dev/null || continue
    if "$save" 2>/dev/null | grep -q 'KUBE-'; then
      "$save" | grep -v -- 'KUBE-' | "$restore" || log "could not clean $save rules"
    fi
  done
}

# Empty kubepods cgroups the kubelet created (cgroup v1 has one tree per controller).
cleanup_cgroups() {
  local d
  for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice; do
    [[ -d $d ]] || continue
    find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

cmd_down() {
  need_root "hack/cluster.sh down"
  take_lock
  case "${1:-}" in
    --extra-nodes)
      BIN=$("$HACK_DIR/build-k8s.sh" --print-bin-dir)
      extra_nodes_down --api
      check_extra_clean
      log "extra nodes removed"
      return 0
      ;;
    "") ;;
    *) usage ;;
  esac
  [[ -d $DIR ]] || { log "no cluster state in $DIR"; }
  stop kube-proxy kubelet
  stop_containers
  extra_nodes_down
  stop kube-scheduler kube-controller-manager kube-apiserver
  stop etcd
  unmount_under "$KUBELET_DIR"
  unmount_under "$DIR"
  cleanup_network
  cleanup_cgroups
  # rm -rf would walk into a mount that is still there (a pod's hostPath or CSI target).
  local still
  still=$(findmnt -rn -o TARGET | grep -E "^($KUBELET_DIR|$DIR)(/|$)" || true)
  [[ -z $still ]] || die "not removing $KUBELET_DIR and $DIR: still mounted:
$still"
  rm -rf "$KUBELET_DIR" "$DIR"
  # containerd 1.6 keeps shim sockets and fifos under /run/containerd whatever its state
  # dir is; remove them unless a system containerd is using that directory.
  [[ -S /run/containerd/containerd.sock ]] || rm -rf /run/containerd
  rmdir /run/netns 2>/dev/null || true
  # containerd's CNI library caches results there; nothing else of ours uses it.
  rm -rf /var/lib/cni/results
  rmdir /var/lib/cni 2>/dev/null || true
  check_clean
  log "cluster removed"
}

# Fails if anything an extra node made is still there: a process, a mount, a bridge, a rule,
# a cgroup root, its state directory (down --extra-nodes; a full down checks with check_clean).
check_extra_clean() {
  local left=() p cmd c
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    [[ $cmd == *"$DIR/nodes/"* ]] && left+=("process ${p#/proc/}: ${cmd:0:100}")
  done
  while read -r m; do
    [[ -n $m ]] && left+=("mount $m")
  done < <(findmnt -rn -o TARGET | grep -E "^$DIR/nodes(/|$)" || true)
  for c in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '$2 ~ /^sealed[1-9][0-9]*$/ {print $2}'); do
    left+=("network device $c")
  done
  iptables -w -C "${BETWEEN_NODES_RULE[@]}" 2>/dev/null && left+=("iptables rule: ${BETWEEN_NODES_RULE[*]}")
  # A cgroup whose last task is still exiting refuses rmdir for a moment: try again first.
  local d
  for _ in 1 2 3 4 5; do
    c=$(cgroup_controllers | while read -r c; do compgen -G "$c/$NODE_NAME-[0-9]*"; done || true)
    [[ -z $c ]] && break
    for d in $c; do remove_cgroup_root "${d#"$(dirname "$d")/"}"; done
    sleep 1
  done
  for d in $c; do left+=("cgroup $d"); done
  [[ -e $DIR/nodes ]] && left+=("directory $DIR/nodes")
  ((${#left[@]} == 0)) && return 0
  printf 'left behind: %s\n' "${left[@]}" >&2
  die "hack/cluster.sh down --extra-nodes did not clean up completely"
}

# Fails if anything the cluster made is still there: a process, a mount, a device.
check_clean() {
  local left=() p cmd bin
  bin=$("$HACK_DIR/build-k8s.sh" --print-bin-dir)
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    [[ $cmd == *"$DIR/"* || $cmd == "$bin/"* ]] && left+=("process ${p#/proc/}: ${cmd:0:100}")
  done
  while read -r m; do
    [[ -n $m ]] && left+=("mount $m")
  done < <(findmnt -rn -o TARGET | grep -E "^($KUBELET_DIR|$DIR)(/|$)|^/run/netns/cni-" || true)
  ip link show "$BRIDGE" >/dev/null 2>&1 && left+=("network device $BRIDGE")
  local dev
  for dev in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '$2 ~ /^sealed[1-9][0-9]*$/ {print $2}'); do
    left+=("network device $dev")
  done
  ((${#left[@]} == 0)) && return 0
  printf 'left behind: %s\n' "${left[@]}" >&2
  die "hack/cluster.sh down did not clean up completely"
}

# --- extra nodes (up --nodes N) ----------------------------------------------
#
# Node i (2..N) is sealed-node-i: its own containerd, kubelet and mount namespace, bridge
# sealed<i-1> with the node address 10.244.<i-1>.1 and pods in 10.244.<i-1>.0/24, joined to
# the same control plane. Everything it has is under $DIR/nodes/<name>; its processes'
# pids are $RUN/<name>.<component>.pid, their logs $LOGS/<name>.<component>.log.
#
# A DaemonSet has one set of hostPaths for every node, so each extra node runs in a mount
# namespace of its own (a slave of the host's: host mounts reach it, its mounts never reach
# the host) where the directories below are the node's own ($DIR/nodes/<name>/fs/<key>):
# its kubelet root is /var/lib/kubelet there, as on node 1, and a plugin's state, cache and fd
# holder directories are its own, as on a real machine.
NODE_LOCAL_DIRS=(
  kubelet:/var/lib/kubelet
  sealed-volumes:/var/lib/sealed-volumes
  sealed-cache:/var/cache/sealed-volumes
  sealed-fd-holder:/run/sealed-fd-holder
  netns:/run/netns
  cni:/var/lib/cni
  containerd-run:/run/containerd
)
# Extra nodes keep other tests' pods away unless they tolerate this (the chart's default
# `operator: Exists` does) and carry the label.
FLEET_TAINT_KEY=sealedvolumes.io/fleet # =true:NoSchedule
FLEET_LABEL=$FLEET_TAINT_KEY=true
# Between the node bridges pods are routed by the host (connected routes): only packets that
# arrive on a sealed* bridge are forwarded (per-interface forwarding; net.ipv4.ip_forward and
# eth0 stay as they are), only to another sealed* bridge.
BETWEEN_NODES_RULE=(FORWARD -i "sealed+" -o "sealed+" -s 10.244.0.0/16 -d 10.244.0.0/16
  -m comment --comment "sealed-cluster: pods between node bridges" -j ACCEPT)

extra_node_name() { echo "$NODE_NAME-$1"; }
extra_nodes_present() { compgen -G "$DIR/nodes/*/index" >/dev/null; }

# node_vars I: sets N_NAME N_DIR N_RUN N_BRIDGE N_IP N_CIDR N_PKI for extra node I.
node_vars() {
  local i=$1 idx=$(($1 - 1))
  N_NAME=$(extra_node_name "$i")
  N_DIR="$DIR/nodes/$N_NAME"
  N_RUN="$N_DIR/run"
  N_PKI="$N_DIR/pki"
  N_BRIDGE="sealed$idx"
  N_IP="10.244.$idx.1"
  N_CIDR="10.244.$idx.0/24"
  N_SOCK="$N_RUN/containerd.sock"
}

# in_node: the command prefix that runs a program in node $N_NAME's mount namespace (nsenter
# execs it, so the recorded pid is the program's).
in_node() {
  local pid
  pid=$(pid_of "$N_NAME.mountns") || die "no mount namespace for $N_NAME"
  IN_NODE=(nsenter --mount="/proc/$pid/ns/mnt" --)
}

cgroup_controllers() {
  local c
  for c in /sys/fs/cgroup/*; do
    [[ -f $c/cgroup.procs && $(basename "$c") != unified ]] && echo "$c"
  done
}

# The kubelet's --cgroup-root: its kubepods live under /<name>, apart from node 1's /kubepods.
make_cgroup_root() {
  local name=$1 c
  while read -r c; do
    mkdir -p "$c/$name"
    if [[ -f $c/cpuset.cpus ]]; then
      [[ -s $c/$name/cpuset.cpus && $(cat "$c/$name/cpuset.cpus") != "" ]] || cat "$c/cpuset.cpus" >"$c/$name/cpuset.cpus"
      [[ $(cat "$c/$name/cpuset.mems") != "" ]] || cat "$c/cpuset.mems" >"$c/$name/cpuset.mems"
    fi
  done < <(cgroup_controllers)
}
remove_cgroup_root() {
  local name=$1 c
  while read -r c; do
    [[ -d $c/$name ]] && find "$c/$name" -depth -type d -exec rmdir {} \; 2>/dev/null
  done < <(cgroup_controllers)
  return 0
}

node_pki() {
  [[ -f $N_PKI/done ]] && return 0
  mkdir -p "$N_PKI"
  chmod 700 "$N_PKI"
  local saved=$PKI
  PKI=$N_PKI
  ln -sf "$saved/ca.crt" "$N_PKI/ca.crt"
  ln -sf "$saved/ca.key" "$N_PKI/ca.key"
  issue kubelet-client "/O=system:nodes/CN=system:node:$N_NAME" clientAuth
  issue kubelet-server "/CN=$N_NAME" serverAuth "DNS:$N_NAME,IP:$N_IP"
  rm -f "$N_PKI/ca.srl"
  PKI=$saved
  touch "$N_PKI/done"
}

node_network() {
  local i=$1
  if ! ip link show "$N_BRIDGE" >/dev/null 2>&1; then
    ip link add "$N_BRIDGE" type bridge
    ip addr add "$N_IP/24" dev "$N_BRIDGE"
  fi
  ip link set "$N_BRIDGE" up
  # Node 1's bridge forwards too (replies to other nodes' pods leave through it); its first
  # setting is kept to be restored by `down --extra-nodes`.
  [[ -f $DIR/nodes/$BRIDGE.forwarding ]] ||
    cat "/proc/sys/net/ipv4/conf/$BRIDGE/forwarding" >"$DIR/nodes/$BRIDGE.forwarding"
  echo 1 >"/proc/sys/net/ipv4/conf/$BRIDGE/forwarding"
  echo 1 >"/proc/sys/net/ipv4/conf/$N_BRIDGE/forwarding"
  local drop=(FORWARD -i "$N_BRIDGE" ! -o "$N_BRIDGE" -m comment
    --comment "sealed-cluster: pods stay on this machine" -j DROP)
  iptables -w -C "${drop[@]}" 2>/dev/null || iptables -w -I "${drop[@]}"
  # First in the chain, before every bridge's DROP.
  if [[ $(iptables -w -S FORWARD | sed -n 2p) != *"pods between node bridges"* ]]; then
    while iptables -w -C "${BETWEEN_NODES_RULE[@]}" 2>/dev/null; do iptables -w -D "${BETWEEN_NODES_RULE[@]}"; done
    iptables -w -I "${BETWEEN_NODES_RULE[@]}"
  fi
  mkdir -p "$N_DIR/cni/net.d"
  cat >"$N_DIR/cni/net.d/10-sealed.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "$N_NAME",
  "plugins": [
    {
      "type": "bridge", "bridge": "$N_BRIDGE", "isGateway": false, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$N_DIR/cni/ipam",
        "ranges": [[{"subnet": "$N_CIDR", "gateway": "$N_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
}

# The mount namespace: a process that only holds it; containerd and the kubelet join it.
node_mountns() {
  local i=$1 binds=() entry key dst
  is_running "$N_NAME.mountns" && return 0
  for entry in "${NODE_LOCAL_DIRS[@]}"; do
    key=${entry%%:*}
    dst=${entry#*:}
    mkdir -p "$N_DIR/fs/$key"
    # A directory made on the host for the bind is removed again by down if empty.
    if [[ ! -d $dst ]]; then
      mkdir -p "$dst"
      echo "$dst" >>"$DIR/nodes/made-dirs"
    fi
    binds+=("$N_DIR/fs/$key" "$dst")
  done
  rm -f "$LOGS/$N_NAME.mountns.log"
  # pause (from the cluster's binaries) holds it: down's check finds it by its path.
  # shellcheck disable=SC2016 # expanded by the inner shell
  start "$N_NAME.mountns" unshare --mount --propagation slave -- sh -c '
    set -e
    while [ $# -gt 0 ]; do
      mount --bind "$1" "$2" && mount --make-rshared "$2"
      shift 2
    done
    echo ready
    exec "$0"' "$BIN/pause" "${binds[@]}"
  wait_for "$N_NAME mount namespace" 10 grep -q ready "$LOGS/$N_NAME.mountns.log" ||
    die "the mount namespace of $N_NAME did not start; see $LOGS/$N_NAME.mountns.log"
}

node_containerd() {
  local i=$1
  mkdir -p "$N_DIR/containerd" "$N_RUN"
  local d="$N_DIR/containerd/certs.d/$REGISTRY"
  mkdir -p "$d"
  cp "$DIR/containerd/certs.d/$REGISTRY/hosts.toml" "$d/hosts.toml"
  sed -e "s|$DIR/containerd|$N_DIR/containerd|g" -e "s|$CONTAINERD_SOCK|$N_SOCK|g" \
    -e "s|$DIR/cni/net.d|$N_DIR/cni/net.d|g" "$DIR/containerd/config.toml" >"$N_DIR/containerd/config.toml"
  in_node
  start "$N_NAME.containerd" "${IN_NODE[@]}" /usr/bin/containerd --config "$N_DIR/containerd/config.toml"
  wait_for "$N_NAME containerd" 60 ctr --address "$N_SOCK" version ||
    die "containerd of $N_NAME did not start; see $LOGS/$N_NAME.containerd.log"
  SEALED_CLUSTER_DIR="$N_DIR" "$HACK_DIR/images.sh" base >/dev/null
}

node_kubelet() {
  local i=$1
  local saved=$PKI
  PKI=$N_PKI
  kubeconfig "$N_DIR/kubelet.kubeconfig" kubelet-client
  PKI=$saved
  mkdir -p "$N_DIR/pod-logs"
  make_cgroup_root "$N_NAME"
  cat >"$N_DIR/kubelet-config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $N_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: $N_IP
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $N_PKI/kubelet-server.crt
tlsPrivateKeyFile: $N_PKI/kubelet-server.key
containerRuntimeEndpoint: unix://$N_SOCK
cgroupDriver: cgroupfs
cgroupRoot: /$N_NAME
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
podCIDR: $N_CIDR
podLogsDir: $N_DIR/pod-logs
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerWithTaints:
  - {key: $FLEET_TAINT_KEY, value: "true", effect: NoSchedule}
YAML
  local labels="$FLEET_LABEL"
  [[ -n ${NODE_LABELS[$N_NAME]:-} ]] && labels+=",${NODE_LABELS[$N_NAME]}"
  in_node
  start "$N_NAME.kubelet" "${IN_NODE[@]}" "$BIN/kubelet" --config "$N_DIR/kubelet-config.yaml" \
    --kubeconfig "$N_DIR/kubelet.kubeconfig" --root-dir /var/lib/kubelet \
    --hostname-override "$N_NAME" --node-ip "$N_IP" --node-labels "$labels" --v=1
}

# start_extra_node I: node I up and Ready (idempotent).
start_extra_node() {
  local i=$1
  node_vars "$i"
  # containerd and the kubelet live in the namespace: without it, start them again.
  is_running "$N_NAME.mountns" || stop "$N_NAME.kubelet" "$N_NAME.containerd"
  mkdir -p "$N_DIR" "$N_RUN"
  echo "$i" >"$N_DIR/index"
  node_pki
  node_network "$i"
  node_mountns "$i"
  node_containerd "$i"
  node_kubelet "$i"
}

wait_extra_node() {
  node_vars "$1"
  wait_for "node $N_NAME to register" 120 kubectl_admin get node "$N_NAME" ||
    die "the kubelet of $N_NAME did not register; see $LOGS/$N_NAME.kubelet.log"
  kubectl_admin wait --for=condition=Ready "node/$N_NAME" --timeout=180s >/dev/null ||
    die "node $N_NAME is not Ready; see $LOGS/$N_NAME.kubelet.log and $LOGS/$N_NAME.containerd.log"
  # Labels asked for later than the node's first start (the kubelet only sets them at registration).
  [[ -n ${NODE_LABELS[$N_NAME]:-} ]] && kubectl_admin label node "$N_NAME" --overwrite \
    ${NODE_LABELS[$N_NAME]//,/ } >/dev/null
  return 0
}

extra_nodes_up() {
  local n=$1 i
  ((n > 1)) || return 0
  ((n <= 250)) || die "--nodes $n: at most 250"
  mkdir -p "$DIR/nodes"
  for ((i = 2; i <= n; i++)); do start_extra_node "$i"; done
  for ((i = 2; i <= n; i++)); do wait_extra_node "$i"; done
}

# stop_extra_nodes NAME...: every process of those extra nodes, each kind at once for all
# nodes (stop waits up to 10 s per call, not per node).
stop_extra_nodes() {
  local name names=("$@")
  stop "${names[@]/%/.kubelet}"
  for name in "${names[@]}"; do
    node_vars "$(cat "$DIR/nodes/$name/index")"
    is_running "$N_NAME.containerd" || continue
    local t
    for t in $(ctr --address "$N_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$N_SOCK" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
  done
  stop "${names[@]/%/.containerd}"
  local p cmd
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    for name in "${names[@]}"; do
      [[ $cmd == *"-address $DIR/nodes/$name/run/containerd.sock "* ]] && kill -KILL "${p#/proc/}" 2>/dev/null || true
    done
  done
  # With its last process a node's mount namespace goes, and every mount made in it.
  stop "${names[@]/%/.mountns}"
}

# remove_extra_node NAME: what the node made on the host, once its processes are gone.
remove_extra_node() {
  node_vars "$(cat "$DIR/nodes/$1/index")"
  local veth
  for veth in $(ip -o link show master "$N_BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    ip link del "$veth" 2>/dev/null || true
  done
  ip link del "$N_BRIDGE" 2>/dev/null || true
  local drop=(FORWARD -i "$N_BRIDGE" ! -o "$N_BRIDGE" -m comment
    --comment "sealed-cluster: pods stay on this machine" -j DROP)
  while iptables -w -C "${drop[@]}" 2>/dev/null; do iptables -w -D "${drop[@]}"; done
  remove_cgroup_root "$N_NAME"
  unmount_under "$N_DIR"
  local still
  still=$(findmnt -rn -o TARGET | grep -E "^$N_DIR(/|$)" || true)
  [[ -z $still ]] || die "not removing $N_DIR: still mounted:
$still"
  rm -rf "$N_DIR"
  log "node $N_NAME removed"
}

# Removes every extra node and what they changed on the host; node 1 and the control plane stay.
extra_nodes_down() {
  [[ -d $DIR/nodes ]] || return 0
  local d name names=()
  for d in "$DIR"/nodes/*/; do
    [[ -f $d/index ]] && names+=("$(basename "$d")")
  done
  # Their pods and Node objects first, while the API server runs (a full down skips this).
  if ((${#names[@]})) && [[ ${1:-} == --api ]] && kubectl_admin get --raw /readyz >/dev/null 2>&1; then
    for name in "${names[@]}"; do
      kubectl_admin delete node "$name" --ignore-not-found --wait=false >/dev/null 2>&1 || true
      kubectl_admin delete pods -A --field-selector "spec.nodeName=$name" --force --grace-period=0 \
        --wait=false >/dev/null 2>&1 || true
    done
  fi
  if ((${#names[@]})); then
    stop_extra_nodes "${names[@]}"
    for name in "${names[@]}"; do remove_extra_node "$name"; done
  fi
  while iptables -w -C "${BETWEEN_NODES_RULE[@]}" 2>/dev/null; do iptables -w -D "${BETWEEN_NODES_RULE[@]}"; done
  if [[ -f $DIR/nodes/$BRIDGE.forwarding ]]; then
    ip link show "$BRIDGE" >/dev/null 2>&1 &&
      cat "$DIR/nodes/$BRIDGE.forwarding" >"/proc/sys/net/ipv4/conf/$BRIDGE/forwarding"
    rm -f "$DIR/nodes/$BRIDGE.forwarding"
  fi
  if [[ -f $DIR/nodes/made-dirs ]]; then
    # Unless a pod of node 1 has it as a hostPath since (its mount's root is that directory).
    sort -ru "$DIR/nodes/made-dirs" | while read -r d; do
      grep -qsE "^[0-9]+ [0-9]+ [0-9:]+ $d(/[^ ]*)? " /proc/[0-9]*/mountinfo || rmdir "$d" 2>/dev/null || true
    done
    rm -f "$DIR/nodes/made-dirs"
  fi
  rmdir "$DIR/nodes" 2>/dev/null || true
}

# --- up / status -----------------------------------------------------------

healthy() {
  local c
  for c in "$@"; do is_running "$c" || return 1; done
  kubectl_admin get --raw /readyz >/dev/null 2>&1
}

# Serialises up/down: test runners may start several test processes at once.
LOCKED=0
take_lock() {
  ((LOCKED)) && return 0
  LOCKED=1
  exec 9>/run/lock/sealed-cluster.lock
  flock -w 600 9 || die "another hack/cluster.sh has held /run/lock/sealed-cluster.lock for 10 min"
}

# A port held by something else would make a component fail in a confusing way later.
check_ports_free() {
  local port
  for port in "$@"; do
    if ss -Hltn "sport = :$port" | grep -q .; then
      die "port $port is in use by another program (ss -ltnp 'sport = :$port'); stop it first"
    fi
  done
}

cmd_up() {
  need_root "hack/cluster.sh up"
  take_lock
  local node=1 nodes=1
  declare -gA NODE_LABELS=()
  while (($#)); do
    case "$1" in
      --control-plane-only) node=0 ;;
      --nodes) nodes=${2:-}; shift ;;
      --nodes=*) nodes=${1#*=} ;;
      --label)
        [[ ${2:-} == sealed-node-*:*=* ]] || die "--label NODE:KEY=VALUE (NODE: sealed-node-2..N), got '${2:-}'"
        NODE_LABELS[${2%%:*}]+="${NODE_LABELS[${2%%:*}]:+,}${2#*:}"
        shift
        ;;
      *) usage ;;
    esac
    shift
  done
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes N: N is a whole number >= 1, got '$nodes'"
  ((node || nodes == 1)) || die "--nodes $nodes needs the node (not --control-plane-only)"
  BIN=$("$HACK_DIR/build-k8s.sh")
  PAUSE_IMAGE=$("$HACK_DIR/images.sh" pause-name)
  local wanted=("${CONTROL_PLANE[@]}")
  ((node)) && wanted+=("${NODE_COMPONENTS[@]}")
  if [[ -f $KUBECONFIG_ADMIN ]] && healthy "${wanted[@]}"; then
    if ((nodes == 1)); then
      log "cluster already up"
      echo "$KUBECONFIG_ADMIN"
      return 0
    fi
    extra_nodes_up "$nodes"
    log "cluster up with $nodes nodes"
    echo "$KUBECONFIG_ADMIN"
    return 0
  fi
  # A half-started control plane is cheaper to restart than to repair.
  if [[ -d $RUN ]] && ! healthy "${CONTROL_PLANE[@]}"; then
    log "found a stale or partial cluster in $DIR; taking it down first"
    cmd_down
  fi
  local start_s=$SECONDS
  apt_ensure openssl curl iproute2 util-linux
  ((node)) && apt_ensure containerd runc containernetworking-plugins iptables conntrack \
    umoci skopeo busybox-static
  healthy "${CONTROL_PLANE[@]}" || check_ports_free "$ETCD_PORT" 12380 12381 "$APISERVER_PORT" 10257 10259
  ((node)) && ! is_running kubelet && check_ports_free 10250 10248 10249 10256
  mkdir -p "$RUN" "$LOGS"
  gen_pki
  gen_kubeconfigs
  healthy "${CONTROL_PLANE[@]}" || start_control_plane
  ((node)) && start_node
  extra_nodes_up "$nodes"
  log "cluster up in $((SECONDS - start_s))s; export KUBECONFIG=$KUBECONFIG_ADMIN"
  echo "$KUBECONFIG_ADMIN"
}

cmd_status() {
  local c rc=0 pid
  for c in "${CONTROL_PLANE[@]}" "${NODE_COMPONENTS[@]}"; do
    pid=$(pid_of "$c" || true)
    if is_running "$c"; then
      printf '%-24s running (pid %s)\n' "$c" "$pid"
    else
      printf '%-24s not running\n' "$c"
    fi
  done
  local d name
  for d in "$DIR"/nodes/*/; do
    [[ -f $d/index ]] || continue
    name=$(basename "$d")
    for c in mountns containerd kubelet; do
      pid=$(pid_of "$name.$c" || true)
      if is_running "$name.$c"; then
        printf '%-24s running (pid %s)\n' "$name.$c" "$pid"
      else
        printf '%-24s not running\n' "$name.$c"
        rc=1
      fi
    done
  done
  BIN=$("$HACK_DIR/build-k8s.sh" --print-bin-dir)
  if [[ -x $BIN/kubectl && -f $KUBECONFIG_ADMIN ]] && kubectl_admin get --raw /readyz >/dev/null 2>&1; then
    kubectl_admin get nodes -o wide 2>/dev/null || true
  else
    echo "API server: not reachable"
    rc=1
  fi
  return $rc
}

main() {
  local cmd=${1:-}
  shift || true
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status ;;
    kubeconfig) echo "$KUBECONFIG_ADMIN" ;;
    *) usage ;;
  esac
}

main "$@"
