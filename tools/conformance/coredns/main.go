// CoreDNS as the conformance suite's base manifests run it (registry.k8s.io/coredns/coredns,
// Deployment gateway-conformance-infra/coredns, used by the UDPRoute tests), built from the
// CoreDNS module with only the plugins its Corefile names (forward, log, errors, whoami) instead
// of all of them: the same server code, a much smaller build. Nothing can be pulled here.
package main

import (
	_ "github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/whoami"
)

func main() { coremain.Run() }
