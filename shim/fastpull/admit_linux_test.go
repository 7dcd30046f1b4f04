package fastpull

import (
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/tandem-run/tandem/shim/origin"
	"github.com/tandem-run/tandem/shim/principal"
	"github.com/tandem-run/tandem/shim/server"
)

// rootOnly admits uid 0 alone.
type rootOnly struct{}

func (rootOnly) Decide(uid uint32) principal.Decision {
	return principal.Decision{Allowed: uid == 0, Who: "uid " + strconv.Itoa(int(uid)), Why: "not root"}
}

// With the shim's own rule (server.Access: the socket's owner, by the
// kernel's tables), another local account cannot read the image a
// loopback registry serves; root (Docker's daemon) can.
func TestLoopRegistryRefusesOrdinaryAccounts(t *testing.T) {
	bb, url := rootOnlyRegistry(t)
	cmd := exec.Command(bb, "wget", "-q", "-O", "-", url)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err == nil || strings.Contains(string(out), "schemaVersion") {
		t.Fatalf("nobody read the manifest: %q", out)
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("root refused: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("root: %s", resp.Status)
	}
}

// A host-network job shares the host's loopback and may run as root: its
// own mount namespace is what tells it from Docker's daemon. Such a
// client (here unshare's, as a container's process) cannot read the
// image either; the same uid in the host's namespace can.
func TestLoopRegistryRefusesOtherMountNamespaces(t *testing.T) {
	bb, url := rootOnlyRegistry(t)
	out, err := exec.Command("unshare", "--mount", bb, "wget", "-q", "-O", "-", url).CombinedOutput()
	if err == nil || strings.Contains(string(out), "schemaVersion") {
		t.Fatalf("a root client in its own mount namespace read the manifest: %q", out)
	}
	out, err = exec.Command(bb, "wget", "-q", "-O", "-", url).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "schemaVersion") {
		t.Fatalf("root on the host: %v %q", err, out)
	}
}

// rootOnlyRegistry serves a loopback registry under the shim's rule with
// root alone root-equivalent; it returns busybox's path and the URL of
// the image's manifest. The clients the tests run need root and busybox.
func rootOnlyRegistry(t *testing.T) (busybox, manifestURL string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run clients as another account or in another namespace")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox missing")
	}
	access := server.Access{Check: origin.Checker{}.CheckBatch, Principals: rootOnly{}}
	r, img, _ := testRegistry(t, testSpool(t, randomBytes(10), ""), access.AdmitRegistryConn)
	return bb, "http://" + r.Host() + "/v2/" + img.repo + "/manifests/v1"
}
