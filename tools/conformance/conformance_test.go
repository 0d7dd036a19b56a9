// The upstream Gateway API conformance suite, run as upstream's own conformance_test.go runs it:
// every option comes from its flags (scripts/check-conformance passes them). Nothing of upstream is
// copied here; the suite, its tests and its base manifests come from the module
// sigs.k8s.io/gateway-api/conformance at the version go.mod names.
package conformance_test

import (
	"testing"

	"sigs.k8s.io/gateway-api/conformance"
)

func TestConformance(t *testing.T) {
	conformance.RunConformance(t)
}
