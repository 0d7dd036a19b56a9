// kubeharness: a throw-away Kubernetes control plane for tests, built from k8s.io/kubernetes.
//
//	kubeharness up --dir D [--node] [--node-images DIR] [--keep] [--timeout 180s]
//
// runs etcd in this process (go.etcd.io/etcd/server/v3/embed, fsync off, 127.0.0.1 only), generates a
// CA, a serving certificate (IP SAN 127.0.0.1, DNS localhost), an admin client certificate
// (O=system:masters) and a service-account key, then re-executes itself busybox-style as
// `kubeharness kube-apiserver ...` and `kubeharness kube-controller-manager ...`. When the apiserver
// answers /readyz and the controller manager has created the default ServiceAccount, it writes
// D/kubeconfig and prints a line starting with READY. SIGTERM/SIGINT stops everything; children also
// die with this process (Pdeathsig). State lives in D/data (removed on exit unless --keep), component
// logs in D/logs. With --node it also runs kube-scheduler and a node (containerd, kubelet,
// kube-proxy in a network namespace of its own, see node.go); `kubeharness image` writes OCI image
// archives for that node (image.go).
package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "kube-apiserver":
			os.Exit(runCobra(apiserver.NewAPIServerCommand()))
		case "kube-controller-manager":
			os.Exit(runCobra(kcm.NewControllerManagerCommand()))
		case "kube-scheduler":
			os.Exit(runCobra(scheduler.NewSchedulerCommand()))
		case "kubelet":
			os.Exit(runCobra(kubelet.NewKubeletCommand(context.Background())))
		case "kube-proxy":
			os.Exit(runCobra(proxy.NewProxyCommand()))
		case "image":
			os.Exit(image(os.Args[2:]))
		case "up":
			os.Exit(up(os.Args[2:]))
		}
	}
	fmt.Fprintln(os.Stderr, "usage: kubeharness up --dir D [--node] [--node-images DIR] [--keep] [--timeout 180s]\n"+
		"       kubeharness image --out F.tar --name REF [--entrypoint /x] [--user U:G] SRC=DEST[:MODE]...\n"+
		"       kubeharness kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy [flags]")
	os.Exit(2)
}

func runCobra(c *cobra.Command) int { c.SetArgs(os.Args[2:]); return cli.Run(c) }

type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

type harness struct {
	dir, data, pki, logs string
	etcd                 *embed.Etcd
	procs                []*proc
	exited               chan *proc
	client               *http.Client
	node                 *node  // with --node
	images               string // --node-images: OCI archives imported into the node's containerd
}

func up(args []string) int {
	fs := flag.NewFlagSet("up", flag.ContinueOnError)
	dir := fs.String("dir", "", "state directory (required)")
	keep := fs.Bool("keep", false, "keep D/data (etcd, pki) and D/kubeconfig on exit")
	timeout := fs.Duration("timeout", 180*time.Second, "startup timeout")
	withNode := fs.Bool("node", false, "also run kube-scheduler and a node (containerd, kubelet, kube-proxy) in a network namespace")
	images := fs.String("node-images", "", "with --node: import every *.tar (OCI archive) of this directory into the node's containerd")
	if fs.Parse(args) != nil || *dir == "" || fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	d, err := filepath.Abs(*dir)
	if err != nil {
		return fail(err)
	}
	// One harness per directory: an exclusive flock on D/lock, held until exit (not inherited by the
	// children, Go opens files O_CLOEXEC). It guards the rm -rf of D/data below.
	if err := os.MkdirAll(d, 0o755); err != nil {
		return fail(err)
	}
	lock, err := os.OpenFile(filepath.Join(d, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fail(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		other, _ := os.ReadFile(lock.Name())
		return fail(fmt.Errorf("%s is in use by another kubeharness (pid %s)", d, strings.TrimSpace(string(other))))
	}
	_ = lock.Truncate(0)
	_, _ = lock.WriteAt([]byte(fmt.Sprintf("%d\n", os.Getpid())), 0)
	h := &harness{dir: d, data: filepath.Join(d, "data"), logs: filepath.Join(d, "logs"), exited: make(chan *proc, 8)}
	h.pki = filepath.Join(h.data, "pki")
	if *withNode {
		h.node, h.images = newNode(d), *images
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	err = h.run(ctx, *timeout)
	h.stop(*keep)
	if err != nil && ctx.Err() == nil {
		return fail(err)
	}
	log("stopped")
	return 0
}

func (h *harness) run(ctx context.Context, timeout time.Duration) error {
	start := time.Now()
	_ = os.RemoveAll(h.data) // always start from a fresh etcd: ports change between runs
	_ = os.Remove(filepath.Join(h.dir, "kubeconfig"))
	for _, d := range []string{h.pki, h.logs} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	var extraIPs []net.IP
	advertise, reconciler := "127.0.0.1", "none" // the loopback address may not be written into Endpoints
	if n := h.node; n != nil {
		n.cleanStale()
		if err := n.setupNet(); err != nil {
			return fmt.Errorf("node network: %w", err)
		}
		log("node network namespace %s: host side %s, node %s (%s)", n.netns, n.hostIP, n.nodeIP, since(start))
		extraIPs = append(extraIPs, net.ParseIP(n.hostIP))
		advertise, reconciler = n.hostIP, "lease"
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	if err := h.startEtcd(etcdURL, fmt.Sprintf("http://127.0.0.1:%d", ports[1])); err != nil {
		return err
	}
	log("etcd ready on %s (%s)", etcdURL, since(start))
	if err := h.writePKI(extraIPs...); err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	pki := func(f string) string { return filepath.Join(h.pki, f) }
	if err := h.spawn("kube-apiserver",
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address="+advertise, fmt.Sprintf("--secure-port=%d", ports[2]),
		"--cert-dir="+h.pki, "--tls-cert-file="+pki("apiserver.crt"), "--tls-private-key-file="+pki("apiserver.key"),
		"--client-ca-file="+pki("ca.crt"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+pki("sa.key"), "--service-account-signing-key-file="+pki("sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--endpoint-reconciler-type="+reconciler,
		"--kubelet-preferred-address-types=InternalIP", // the node's name resolves nowhere
		"--allow-privileged=true",
		"--profiling=false",
	); err != nil {
		return err
	}
	if err := h.waitFor(ctx, "kube-apiserver /readyz", start.Add(timeout), func() bool { return h.get(server+"/readyz") == 200 }); err != nil {
		return err
	}
	log("kube-apiserver ready on %s (%s)", server, since(start))
	kubeconfig := filepath.Join(h.dir, "kubeconfig")
	if err := h.writeKubeconfig(kubeconfig, server); err != nil {
		return err
	}
	controllers := "garbage-collector-controller,namespace-controller,serviceaccount-controller," +
		"serviceaccount-token-controller,root-ca-certificate-publisher-controller"
	if h.node != nil {
		controllers += ",deployment-controller,replicaset-controller,statefulset-controller,daemonset-controller," +
			"job-controller,endpoints-controller,endpointslice-controller,endpointslice-mirroring-controller," +
			"pod-garbage-collector-controller,disruption-controller,ttl-after-finished-controller,node-lifecycle-controller"
	}
	if err := h.spawn("kube-controller-manager",
		"--kubeconfig="+kubeconfig,
		"--controllers="+controllers,
		"--leader-elect=false", "--use-service-account-credentials=false",
		"--bind-address=127.0.0.1", "--secure-port=0",
		"--root-ca-file="+pki("ca.crt"), "--service-account-private-key-file="+pki("sa.key"),
		"--profiling=false",
	); err != nil {
		return err
	}
	// The serviceaccount controller creating "default" proves the controller manager is up and syncing.
	saURL := server + "/api/v1/namespaces/default/serviceaccounts/default"
	if err := h.waitFor(ctx, "kube-controller-manager (default ServiceAccount)", start.Add(timeout), func() bool { return h.get(saURL) == 200 }); err != nil {
		return err
	}
	nodeInfo := ""
	if h.node != nil {
		if err := h.startNode(ctx, start, timeout, kubeconfig, server, ports[2]); err != nil {
			return err
		}
		nodeInfo = fmt.Sprintf(" node=%s netns=%s host-ip=%s", nodeName, h.node.netns, h.node.hostIP)
	}
	fmt.Printf("KUBECONFIG=%s\nREADY server=%s etcd=%s%s startup=%s\n", kubeconfig, server, etcdURL, nodeInfo, since(start))
	select {
	case <-ctx.Done():
		return nil
	case p := <-h.exited:
		return fmt.Errorf("%s exited: %v%s", p.name, p.err, tail(p.log))
	case err := <-h.etcd.Err():
		return fmt.Errorf("etcd: %w", err)
	}
}

func (h *harness) startEtcd(clientURL, peerURL string) error {
	cfg := embed.NewConfig()
	cfg.Name = "kubeharness"
	cfg.Dir = filepath.Join(h.data, "etcd")
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(h.logs, "etcd.log")}
	cu, _ := url.Parse(clientURL)
	pu, _ := url.Parse(peerURL)
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	h.etcd = e
	select {
	case <-e.Server.ReadyNotify():
		return nil
	case err := <-e.Err():
		return fmt.Errorf("etcd: %w", err)
	case <-time.After(60 * time.Second):
		return errors.New("etcd did not become ready in 60s")
	}
}

// spawn re-executes this binary as one control-plane component, output to D/logs/NAME.log.
func (h *harness) spawn(name string, args ...string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	return h.spawnCmd(name, append([]string{self, name}, args...))
}

// spawnCmd starts argv as component NAME, output to D/logs/NAME.log.
func (h *harness) spawnCmd(name string, argv []string) error {
	p := &proc{name: name, log: filepath.Join(h.logs, name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		return err
	}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", name, err)
	}
	log("%s started, pid %d, log %s", name, p.cmd.Process.Pid, p.log)
	h.procs = append(h.procs, p)
	go func() { p.err = p.cmd.Wait(); f.Close(); close(p.done); h.exited <- p }()
	return nil
}

func (h *harness) waitFor(ctx context.Context, what string, deadline time.Time, ok func() bool) error {
	for !ok() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case p := <-h.exited:
			return fmt.Errorf("%s exited while waiting for %s: %v%s", p.name, what, p.err, tail(p.log))
		case <-time.After(250 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			msg := fmt.Sprintf("timed out waiting for %s", what)
			for _, p := range h.procs {
				msg += tail(p.log)
			}
			return errors.New(msg)
		}
	}
	return nil
}

// stop terminates the components in reverse start order, then etcd.
func (h *harness) stop(keep bool) {
	for i := len(h.procs) - 1; i >= 0; i-- {
		p := h.procs[i]
		if p.name == "containerd" {
			h.node.teardownPods() // kubelet is stopped: nothing restarts the pods
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			log("%s did not stop in 15s, killing", p.name)
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	if h.etcd != nil {
		h.etcd.Close()
	}
	if h.node != nil {
		h.node.teardown(keep)
	}
	if !keep {
		_ = os.RemoveAll(h.data)
		_ = os.Remove(filepath.Join(h.dir, "kubeconfig"))
	}
}

func (h *harness) get(u string) int {
	resp, err := h.client.Get(u)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

type keyPair struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func (h *harness) writePKI(extraIPs ...net.IP) error {
	ca, err := h.issue("ca", &x509.Certificate{Subject: pkix.Name{CommonName: "kubeharness-ca"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}, nil)
	if err != nil {
		return err
	}
	if _, err := h.issue("apiserver", &x509.Certificate{Subject: pkix.Name{CommonName: "kube-apiserver"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: append([]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")}, extraIPs...),
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}}, ca); err != nil {
		return err
	}
	admin, err := h.issue("admin", &x509.Certificate{Subject: pkix.Name{CommonName: "kubeharness-admin", Organization: []string{"system:masters"}},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}, ca)
	if err != nil {
		return err
	}
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	if err := writeKey(filepath.Join(h.pki, "sa.key"), sa); err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	h.client = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: pool, Certificates: []tls.Certificate{{Certificate: [][]byte{admin.cert.Raw}, PrivateKey: admin.key}}}}}
	return nil
}

// issue creates NAME.crt/NAME.key in the pki dir, signed by parent (self-signed when parent is nil).
func (h *harness) issue(name string, tmpl *x509.Certificate, parent *keyPair) (*keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber, _ = rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().AddDate(1, 0, 0)
	signer, signerKey := tmpl, key
	if parent != nil {
		signer, signerKey = parent.cert, parent.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		return nil, err
	}
	cert, _ := x509.ParseCertificate(der)
	kp := &keyPair{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
	if err := os.WriteFile(filepath.Join(h.pki, name+".crt"), kp.pem, 0o600); err != nil {
		return nil, err
	}
	return kp, writeKey(filepath.Join(h.pki, name+".key"), key)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600)
}

func (h *harness) writeKubeconfig(path, server string) error {
	read := func(f string) []byte { b, _ := os.ReadFile(filepath.Join(h.pki, f)); return b }
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kube-env"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: read("ca.crt")}
	cfg.AuthInfos["kube-env-admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: read("admin.crt"), ClientKeyData: read("admin.key")}
	cfg.Contexts["kube-env"] = &clientcmdapi.Context{Cluster: "kube-env", AuthInfo: "kube-env-admin", Namespace: "default"}
	cfg.CurrentContext = "kube-env"
	if err := clientcmd.WriteToFile(*cfg, path+".tmp"); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path) // readers never see a half-written file
}

func freePorts(n int) ([]int, error) {
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// tail returns the last lines of a component log, for error messages.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > 25 {
		lines = lines[len(lines)-25:]
	}
	return fmt.Sprintf("\n--- last lines of %s ---\n%s", path, bytes.Join(lines, []byte("\n")))
}

func since(t time.Time) string { return time.Since(t).Round(10 * time.Millisecond).String() }

func log(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubeharness: "+strings.TrimSuffix(format, "\n")+"\n", args...)
}

func fail(err error) int {
	log("error: %v", err)
	return 1
}
