// The node of `kubeharness up --node`: a network namespace the harness makes (veth pair to the host,
// no default route, so nothing leaves it), containerd (private root/state/socket under D/node),
// kubelet and kube-proxy inside it, kube-scheduler next to the control plane, and a small DNS
// responder for the pods. See tools/kube-env/README.md ("The node").
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/net/dns/dnsmessage"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	cri "k8s.io/cri-client/pkg"
)

const (
	nodeName    = "kube-env-node"
	podCIDR     = "10.244.0.0/24"
	clusterCIDR = "10.244.0.0/16"
)

// node is the state of the node part of a harness; everything it makes is undone by teardown.
type node struct {
	dir                   string // D/node
	id                    string // short hash of D: names of the netns, veth and cgroup root
	netns, vethHost       string
	hostIP, nodeIP        string
	sock                  string // containerd's socket
	cgroupRoot            string
	netnsMade, vethMade   bool
	dns                   *net.UDPConn
	apiProxy              net.Listener
	hostsFile, kubeconfig string
	// serviceIP answers NAME.NAMESPACE.svc.cluster.local from the apiserver (set by startNode)
	serviceIP func(ns, name string) net.IP
}

func newNode(d string) *node {
	sum := sha256.Sum256([]byte(d))
	id := hex.EncodeToString(sum[:])[:8]
	// 10.215.A.B/30 from the hash: host side .B+1, node side .B+2.
	a, b := int(sum[4])%64+128, (int(sum[5])%64)*4
	n := &node{dir: filepath.Join(d, "node"), id: id, netns: "kenv-" + id, vethHost: "kenv" + id,
		hostIP: fmt.Sprintf("10.215.%d.%d", a, b+1), nodeIP: fmt.Sprintf("10.215.%d.%d", a, b+2),
		cgroupRoot: "/kube-env-" + id}
	n.sock = filepath.Join(n.dir, "containerd", "containerd.sock")
	n.hostsFile = filepath.Join(n.dir, "hosts")
	n.kubeconfig = filepath.Join(n.dir, "kubeconfig")
	return n
}

func sh(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// cleanStale removes what a harness of the same D left behind when it was killed (-9).
func (n *node) cleanStale() {
	n.killCgroups()
	if _, err := os.Stat("/run/netns/" + n.netns); err == nil {
		n.killNetnsPids()
		_ = sh("ip", "netns", "del", n.netns)
	}
	_ = sh("ip", "link", "del", n.vethHost)
	n.unmountUnder(n.dir)
}

// setupNet makes the namespace and the veth pair. The host side has an address only the harness
// uses (the apiserver proxy, the DNS responder and whatever the tests bind there, e.g. an edge).
func (n *node) setupNet() error {
	if err := os.MkdirAll(n.dir, 0o755); err != nil {
		return err
	}
	if out, _ := exec.Command("ip", "-4", "-o", "addr", "show", "to", n.hostIP+"/30").Output(); len(out) > 0 {
		return fmt.Errorf("%s/30 is already in use on this machine: %s", n.hostIP, strings.TrimSpace(string(out)))
	}
	if err := sh("ip", "netns", "add", n.netns); err != nil {
		return err
	}
	n.netnsMade = true
	peer := "kenvn" + n.id[:6]
	if err := sh("ip", "link", "add", n.vethHost, "type", "veth", "peer", "name", peer); err != nil {
		return err
	}
	n.vethMade = true
	steps := [][]string{
		{"ip", "link", "set", peer, "netns", n.netns},
		{"ip", "addr", "add", n.hostIP + "/30", "dev", n.vethHost},
		{"ip", "link", "set", n.vethHost, "up"},
		{"ip", "-n", n.netns, "link", "set", "lo", "up"},
		{"ip", "-n", n.netns, "link", "set", peer, "name", "eth0"},
		{"ip", "-n", n.netns, "addr", "add", n.nodeIP + "/30", "dev", "eth0"},
		{"ip", "-n", n.netns, "link", "set", "eth0", "up"},
		// No default route: a packet for anywhere but the /30, the pods and the Service IPs has
		// no way out. Service IPs need a route for the OUTPUT-chain DNAT of kube-proxy.
		{"ip", "-n", n.netns, "route", "add", "10.0.0.0/24", "dev", "eth0", "src", n.nodeIP},
		{"ip", "netns", "exec", n.netns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"},
		{"ip", "netns", "exec", n.netns, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"},
	}
	for _, s := range steps {
		if err := sh(s[0], s[1:]...); err != nil {
			return err
		}
	}
	return nil
}

// inNetns wraps a command so it runs in the node's network namespace only (nsenter keeps the mount
// namespace, unlike `ip netns exec`: kubelet's volume mounts must be seen by containerd).
func (n *node) inNetns(args ...string) []string {
	return append([]string{"nsenter", "--net=/run/netns/" + n.netns, "--"}, args...)
}

// startAPIProxy forwards HOST_IP:PORT to the apiserver on 127.0.0.1:PORT (same port, so the
// apiserver can advertise HOST_IP:PORT in the kubernetes Service's endpoints).
func (n *node) startAPIProxy(port int) error {
	l, err := net.Listen("tcp", fmt.Sprintf("%s:%d", n.hostIP, port))
	if err != nil {
		return err
	}
	n.apiProxy = l
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
				if err != nil {
					return
				}
				defer u.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(u, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, u); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	return nil
}

// startDNS answers A queries on HOST_IP:53 from D/node/hosts ("IP NAME" lines, NAME may be
// "*.domain"), read on every query so tests can add names at any time, and SERVICE.NS.svc.cluster.local
// with the Service's ClusterIP (asked of the apiserver). Everything else: NXDOMAIN. This is all the
// pods get for DNS (no CoreDNS image here); culvert itself only needs the edge's name.
func (n *node) startDNS() error {
	if err := os.WriteFile(n.hostsFile, []byte("# IP NAME (NAME may be *.domain); answered by kubeharness on the node's DNS address\n"), 0o644); err != nil {
		return err
	}
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.ParseIP(n.hostIP), Port: 53})
	if err != nil {
		return err
	}
	n.dns = c
	go func() {
		buf := make([]byte, 1500)
		for {
			k, from, err := c.ReadFromUDP(buf)
			if err != nil {
				return
			}
			if resp := n.answer(buf[:k]); resp != nil {
				_, _ = c.WriteToUDP(resp, from)
			}
		}
	}()
	return os.WriteFile(filepath.Join(n.dir, "resolv.conf"), []byte("nameserver "+n.hostIP+"\n"), 0o644)
}

func (n *node) lookup(name string) net.IP {
	name = strings.ToLower(strings.TrimSuffix(name, "."))
	if rest, ok := strings.CutSuffix(name, ".svc.cluster.local"); ok && n.serviceIP != nil {
		if svc, ns, ok := strings.Cut(rest, "."); ok && dnsLabel(svc) && dnsLabel(ns) {
			return n.serviceIP(ns, svc)
		}
		return nil
	}
	b, _ := os.ReadFile(n.hostsFile)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		ip := net.ParseIP(f[0]).To4()
		for _, pat := range f[1:] {
			pat = strings.ToLower(strings.TrimSuffix(pat, "."))
			if ip != nil && (pat == name || (strings.HasPrefix(pat, "*.") && strings.HasSuffix(name, pat[1:]))) {
				return ip
			}
		}
	}
	return nil
}

func (n *node) answer(req []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(req)
	if err != nil {
		return nil
	}
	q, err := p.Question()
	if err != nil {
		return nil
	}
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	ip := n.lookup(q.Name.String())
	if ip == nil {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	_ = b.StartQuestions()
	_ = b.Question(q)
	if ip != nil && q.Type == dnsmessage.TypeA {
		_ = b.StartAnswers()
		var a [4]byte
		copy(a[:], ip)
		_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 5}, dnsmessage.AResource{A: a})
	}
	out, err := b.Finish()
	if err != nil {
		return nil
	}
	return out
}

func (n *node) writeConfigs(ca string) error {
	for _, d := range []string{"containerd", "cni/net.d", "cni/ipam", "kubelet", "pod-logs"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			return err
		}
	}
	cd := filepath.Join(n.dir, "containerd")
	files := map[string]string{
		"containerd/config.toml": fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # This machine denies lowering oom_score_adj (CAP_SYS_RESOURCE): keep pods at containerd's own score.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, filepath.Join(cd, "root"), filepath.Join(cd, "state"), n.sock, n.sock+".ttrpc", filepath.Join(cd, "opt"),
			pauseImage, filepath.Join(n.dir, "cni/net.d")),
		"cni/net.d/10-kube-env.conflist": fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "kube-env",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, filepath.Join(n.dir, "cni/ipam"), podCIDR),
		"kubelet/config.yaml": fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
podLogsDir: %s
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
cgroupDriver: cgroupfs
cgroupRoot: %s
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
containerRuntimeEndpoint: unix://%s
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
address: %s
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
clusterDomain: cluster.local
clusterDNS: [%s]
resolvConf: %s
podCIDR: %s
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
rotateCertificates: false
serverTLSBootstrap: false
shutdownGracePeriod: 0s
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
`, filepath.Join(n.dir, "pod-logs"), n.cgroupRoot, n.sock, n.nodeIP, n.hostIP, filepath.Join(n.dir, "resolv.conf"), podCIDR),
		"kube-proxy.yaml": fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %s}
mode: iptables
clusterCIDR: %s
hostnameOverride: %s
bindAddress: %s
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {masqueradeAll: true, localhostNodePorts: false, syncPeriod: 10s, minSyncPeriod: 0s}
`, n.kubeconfig, clusterCIDR, nodeName, n.nodeIP),
	}
	_ = ca
	for f, c := range files {
		if err := os.WriteFile(filepath.Join(n.dir, f), []byte(c), 0o644); err != nil {
			return err
		}
	}
	env := fmt.Sprintf("NODE_NETNS=%s\nNODE_HOST_IP=%s\nNODE_IP=%s\nNODE_CONTAINERD_SOCK=%s\nNODE_HOSTS=%s\nNODE_NAME=%s\nNODE_POD_CIDR=%s\nNODE_CGROUP_ROOT=%s\n",
		n.netns, n.hostIP, n.nodeIP, n.sock, n.hostsFile, nodeName, podCIDR, n.cgroupRoot)
	return os.WriteFile(filepath.Join(filepath.Dir(n.dir), "node.env"), []byte(env), 0o644)
}

// pauseImage is the name the pause image of D/node is imported as (kubeharness image makes it).
const pauseImage = "registry.k8s.io/pause:kube-env"

// waitSocket waits until containerd answers on its socket.
func waitSocket(ctx context.Context, path string, deadline time.Time) error {
	for {
		if c, err := net.Dial("unix", path); err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear", path)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stopSandboxes stops and removes every pod sandbox through CRI, so containerd runs CNI DEL (veths,
// IP allocations, pod network namespaces) and unmounts the containers' root filesystems.
func (n *node) stopSandboxes() {
	if _, err := os.Stat(n.sock); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rs, err := cri.NewRemoteRuntimeService(ctx, "unix://"+n.sock, 10*time.Second, noop.NewTracerProvider(), false)
	if err != nil {
		log("node: CRI: %v", err)
		return
	}
	pods, err := rs.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{})
	if err != nil {
		log("node: CRI list: %v", err)
		return
	}
	for _, p := range pods {
		if err := rs.StopPodSandbox(ctx, p.Id); err != nil {
			log("node: stop sandbox %s: %v", p.Id, err)
		}
		if err := rs.RemovePodSandbox(ctx, p.Id); err != nil {
			log("node: remove sandbox %s: %v", p.Id, err)
		}
	}
	log("node: removed %d pod sandboxes", len(pods))
}

// makeCgroupRoot creates the kubelet's cgroup root in every cgroup v1 hierarchy (kubelet wants it
// to exist); cpuset needs its cpus and mems copied from the parent before anything can join it.
func (n *node) makeCgroupRoot() error {
	if cgroupV2() { // one hierarchy (not tried here: this machine has cgroup v1 only)
		return os.MkdirAll(filepath.Join("/sys/fs/cgroup", n.cgroupRoot), 0o755)
	}
	ents, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.IsDir() || e.Name() == "unified" {
			continue
		}
		d := filepath.Join("/sys/fs/cgroup", e.Name(), n.cgroupRoot)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		if e.Name() == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuset", f))
				if err == nil {
					_ = os.WriteFile(filepath.Join(d, f), b, 0o644)
				}
			}
		}
	}
	return nil
}

// killCgroups kills what is left in the node's cgroup root (containers), then removes the cgroups.
func (n *node) killCgroups() {
	ctrls := []string{"pids", "memory", "cpu", "cpuacct", "cpuset", "blkio", "devices", "freezer", "hugetlb", "systemd", "perf_event", "net_cls", "net_prio"}
	if cgroupV2() {
		ctrls = []string{""}
	}
	for _, ctrl := range ctrls {
		root := filepath.Join("/sys/fs/cgroup", ctrl, n.cgroupRoot)
		if _, err := os.Stat(root); err != nil {
			continue
		}
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := 0; i < 20; i++ {
			left := 0
			for _, d := range dirs {
				b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
				for _, f := range strings.Fields(string(b)) {
					var pid int
					if _, err := fmt.Sscan(f, &pid); err == nil && pid > 1 {
						_ = syscall.Kill(pid, syscall.SIGKILL)
						left++
					}
				}
			}
			if left == 0 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		sort.Sort(sort.Reverse(sort.StringSlice(dirs))) // children before parents
		for _, d := range dirs {
			_ = os.Remove(d)
		}
	}
}

func (n *node) killNetnsPids() {
	out, _ := exec.Command("ip", "netns", "pids", n.netns).Output()
	for _, f := range strings.Fields(string(out)) {
		var pid int
		if _, err := fmt.Sscan(f, &pid); err == nil && pid > 1 && pid != os.Getpid() {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder lazily unmounts every mount point below dir, deepest first.
func (n *node) unmountUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mps []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			mps = append(mps, f[4])
		}
	}
	sort.Slice(mps, func(i, j int) bool { return len(mps[i]) > len(mps[j]) })
	for _, m := range mps {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

// teardown runs after kubelet and kube-proxy were stopped and before containerd is.
func (n *node) teardownPods() { n.stopSandboxes() }

// teardown undoes the rest: processes, cgroups, mounts, the namespace (and with it every iptables
// rule, the bridge and the pods' veths), the host side of the veth.
func (n *node) teardown(keep bool) {
	if n.dns != nil {
		n.dns.Close()
	}
	if n.apiProxy != nil {
		n.apiProxy.Close()
	}
	n.killCgroups()
	if n.netnsMade {
		n.killNetnsPids()
	}
	n.unmountUnder(n.dir)
	if n.vethMade {
		_ = sh("ip", "link", "del", n.vethHost)
	}
	if n.netnsMade {
		if err := sh("ip", "netns", "del", n.netns); err != nil {
			log("node: %v", err)
		}
	}
	if !keep {
		if err := os.RemoveAll(filepath.Join(n.dir, "containerd")); err != nil && !errors.Is(err, os.ErrNotExist) {
			log("node: %v", err)
		}
		_ = os.RemoveAll(filepath.Join(n.dir, "kubelet"))
		_ = os.RemoveAll(filepath.Join(n.dir, "cni/ipam"))
	}
}

// startNode runs, after the control plane is ready: the apiserver proxy, kube-scheduler, the DNS
// responder, containerd (+ the images), kubelet (until the Node is Ready) and kube-proxy (until its
// rules for the kubernetes Service exist).
func (h *harness) startNode(ctx context.Context, start time.Time, timeout time.Duration, kubeconfig, server string, port int) error {
	n := h.node
	deadline := start.Add(timeout)
	if err := n.startAPIProxy(port); err != nil {
		return fmt.Errorf("apiserver proxy: %w", err)
	}
	if err := h.writeKubeconfig(n.kubeconfig, fmt.Sprintf("https://%s:%d", n.hostIP, port)); err != nil {
		return err
	}
	if err := h.spawn("kube-scheduler", "--kubeconfig="+kubeconfig, "--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=0", "--profiling=false"); err != nil {
		return err
	}
	n.serviceIP = func(ns, name string) net.IP {
		resp, err := h.client.Get(server + "/api/v1/namespaces/" + ns + "/services/" + name)
		if err != nil {
			return nil
		}
		defer resp.Body.Close()
		var svc struct {
			Spec struct {
				ClusterIP string `json:"clusterIP"`
			} `json:"spec"`
		}
		if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&svc) != nil {
			return nil
		}
		return net.ParseIP(svc.Spec.ClusterIP).To4() // nil for headless ("None")
	}
	if err := n.startDNS(); err != nil {
		return fmt.Errorf("dns on %s:53: %w", n.hostIP, err)
	}
	if err := n.writeConfigs(filepath.Join(h.pki, "ca.crt")); err != nil {
		return err
	}
	for _, b := range []string{"containerd", "runc", "nsenter", "iptables", "/usr/lib/cni/bridge"} {
		if _, err := exec.LookPath(b); err != nil {
			return fmt.Errorf("%s not found: install containerd, runc, containernetworking-plugins, iptables, util-linux (scripts/kube-env does)", b)
		}
	}
	if err := h.spawnCmd("containerd", n.inNetns("containerd", "--config", filepath.Join(n.dir, "containerd/config.toml"))); err != nil {
		return err
	}
	if err := waitSocket(ctx, n.sock, deadline); err != nil {
		return fmt.Errorf("containerd: %w%s", err, tail(filepath.Join(h.logs, "containerd.log")))
	}
	log("containerd ready on %s (%s)", n.sock, since(start))
	if h.images != "" {
		tars, _ := filepath.Glob(filepath.Join(h.images, "*.tar"))
		for _, t := range tars {
			if err := sh("ctr", "--address", n.sock, "-n", "k8s.io", "images", "import", "--no-unpack", t); err != nil {
				return err
			}
		}
		log("imported %d images from %s (%s)", len(tars), h.images, since(start))
	}
	if err := n.makeCgroupRoot(); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	kl := filepath.Join(n.dir, "kubelet")
	if err := h.spawnCmd("kubelet", n.inNetns(self, "kubelet", "--config="+filepath.Join(kl, "config.yaml"),
		"--kubeconfig="+n.kubeconfig, "--hostname-override="+nodeName, "--node-ip="+n.nodeIP,
		"--root-dir="+filepath.Join(kl, "root"), "--cert-dir="+filepath.Join(kl, "pki"), "--v=1")); err != nil {
		return err
	}
	nodeURL := server + "/api/v1/nodes/" + nodeName
	if err := h.waitFor(ctx, "kubelet (Node "+nodeName+" Ready, untainted)", deadline, func() bool { return h.nodeReady(nodeURL) }); err != nil {
		return err
	}
	log("node %s Ready (%s)", nodeName, since(start))
	if err := h.spawnCmd("kube-proxy", n.inNetns(self, "kube-proxy", "--config="+filepath.Join(n.dir, "kube-proxy.yaml"))); err != nil {
		return err
	}
	rules := func() bool {
		out, err := exec.Command("ip", "netns", "exec", n.netns, "iptables", "-t", "nat", "-S", "KUBE-SERVICES").Output()
		return err == nil && strings.Contains(string(out), "default/kubernetes:https")
	}
	if err := h.waitFor(ctx, "kube-proxy (rules for default/kubernetes)", deadline, rules); err != nil {
		return err
	}
	log("kube-proxy rules in place (%s)", since(start))
	return nil
}

func (h *harness) nodeReady(u string) bool {
	resp, err := h.client.Get(u)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var nd struct {
		Spec struct {
			Taints []struct{ Key string } `json:"taints"`
		} `json:"spec"`
		Status struct {
			Conditions []struct{ Type, Status string } `json:"conditions"`
		} `json:"status"`
	}
	if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&nd) != nil {
		return false
	}
	for _, t := range nd.Spec.Taints {
		if t.Key == "node.kubernetes.io/not-ready" { // removed by the node-lifecycle controller
			return false
		}
	}
	for _, c := range nd.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func dnsLabel(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for _, c := range s {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

func cgroupV2() bool {
	_, err := os.Stat("/sys/fs/cgroup/cgroup.controllers")
	return err == nil
}
