# A real node beside the control plane: containerd (Debian's 1.6) with runc and the CNI
# bridge, kube-proxy and a kubelet v1.33.13 built by build.sh. Sourced by `up.sh --node`
# (which runs only inside sandbox.sh); uses up.sh's start/wait_for/issue helpers and
# variables. Images come from OCI archives (`ctr images import`); nothing is pulled.

NODE_NAME=tw-node
POD_CIDR=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
CNI_BIN="${CNI_BIN:-/usr/lib/cni}"
IMAGES_DIR="${NODE_IMAGES_DIR:-$REPO/.cache/images}"

node_certs() {
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  issue kubelet-client "/O=system:nodes/CN=system:node:$NODE_NAME"
  issue kubelet "/CN=$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
  issue kube-proxy "/CN=system:kube-proxy"
  chmod 600 "$PKI"/*.key
}

node_check() {
  local t
  for t in containerd containerd-shim-runc-v2 runc ctr iptables conntrack; do
    command -v "$t" >/dev/null || { log "$t not found (make system-deps installs containerd, runc, iptables, conntrack)"; return 1; }
  done
  [[ -x "$CNI_BIN/bridge" && -x "$CNI_BIN/host-local" && -x "$CNI_BIN/portmap" ]] ||
    { log "CNI plugins not in $CNI_BIN (make system-deps installs containernetworking-plugins)"; return 1; }
  for t in kubelet kube-proxy; do [[ -x "$BIN/$t" ]] || { log "missing $BIN/$t"; return 1; }; done
  [[ -f "$IMAGES_DIR/pause.tar" ]] || { log "no $IMAGES_DIR/pause.tar (images/build.sh pause)"; return 1; }
}

start_node() {
  local t; t="$(now)"
  local N="$DIR/node"; mkdir -p "$N/cni"
  PAUSE_IMAGE="$(cat "$IMAGES_DIR/pause.ref")"

  # containerd. Root, state and sockets are on sandbox.sh's tmpfs (/var/lib, /run), so they
  # vanish with the sandbox. restrict_oom_score_adj: root here may lack CAP_SYS_RESOURCE,
  # and runc fails to lower a container's oom_score_adj without it.
  cat > "$N/containerd.toml" <<EOF
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$N/cni"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$N/registry-none"
EOF
  cat > "$N/cni/10-tailwarden.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tailwarden-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  start containerd containerd --config "$N/containerd.toml"
  containerd_ready() { ctr --address /run/containerd/containerd.sock version; }
  wait_for containerd "containerd socket" containerd_ready
  log "containerd ready in $(since "$t")s"

  # Images: imported from their archives into the CRI namespace, unpacked for overlayfs.
  local ti img n=0; ti="$(now)"
  for img in ${NODE_IMAGES:-pause operator sidecar openai-app}; do
    [[ -f "$IMAGES_DIR/$img.tar" ]] || { [[ "$img" == pause ]] && return 1; continue; }
    ctr --address /run/containerd/containerd.sock -n k8s.io images import \
      "$IMAGES_DIR/$img.tar" >>"$DIR/logs/ctr.log" 2>&1 || { log "ctr images import $img.tar failed"; return 1; }
    n=$((n + 1))
  done
  log "$n images imported in $(since "$ti")s"

  # kube-proxy (iptables mode, in the sandbox's own netfilter tables). The conntrack
  # settings at 0 leave the conntrack sysctls alone.
  kubeconfig "$PKI/kube-proxy.kubeconfig" system:kube-proxy kube-proxy
  cat > "$N/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $PKI/kube-proxy.kubeconfig}
mode: iptables
hostnameOverride: $NODE_NAME
clusterCIDR: $CLUSTER_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start kube-proxy "$BIN/kube-proxy" --config "$N/kube-proxy.yaml"

  # kubelet. syncFrequency 10 s (default 1 m): how often a running pod's ConfigMap and
  # Secret volumes are refreshed, so the journey's updates land in seconds, through the
  # same atomic ..data swap. No DNS (resolvConf ""), no eviction thresholds or image GC
  # that other work on this machine could trigger, no oom_score_adj of its own
  # (CAP_SYS_RESOURCE again).
  kubeconfig "$PKI/kubelet.kubeconfig" "system:node:$NODE_NAME" kubelet-client
  cat > "$N/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $PKI/kubelet.crt
tlsPrivateKeyFile: $PKI/kubelet.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
cgroupsPerQOS: true
failSwapOn: false
resolvConf: ""
clusterDomain: cluster.local
syncFrequency: 10s
oomScoreAdj: 0
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%"}
evictionPressureTransitionPeriod: 0s
podLogsDir: /var/log/pods
registerNode: true
maxPods: 110
EOF
  start kubelet "$BIN/kubelet" --config "$N/kubelet.yaml" --kubeconfig "$PKI/kubelet.kubeconfig" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --root-dir /var/lib/kubelet \
    --v=1

  node_ready() {
    [[ "$("$KUBECTL" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
  }
  proxy_ready() { curl -sf --max-time 2 http://127.0.0.1:10256/healthz >/dev/null; }
  wait_for kubelet "node $NODE_NAME Ready" node_ready
  wait_for kube-proxy "kube-proxy /healthz" proxy_ready
  NODE_READY_SECONDS="$(since "$t")"
  log "node $NODE_NAME Ready in ${NODE_READY_SECONDS}s (containerd, $n images, kube-proxy, kubelet)"
}
