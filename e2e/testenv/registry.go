package testenv

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/portrange"
)

// Registry is a real local docker-registry with htpasswd auth.
type Registry struct {
	Addr               string // 127.0.0.1:port
	Username, Password string
}

// StartRegistry runs docker-registry (Debian package docker-registry) on a
// free loopback port with one htpasswd user; it stops with the test.
func StartRegistry(t testing.TB) *Registry {
	t.Helper()
	RequireDocker(t)
	dir := t.TempDir()
	r := &Registry{Addr: FreeAddr(t), Username: "tandem", Password: "s3cret-pass"}
	RemoveImagesFrom(t, r.Addr)
	out, err := exec.Command("htpasswd", "-Bbn", r.Username, r.Password).Output()
	if err != nil {
		t.Fatalf("htpasswd (install apache2-utils): %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "htpasswd"), out, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: %s/data
  delete:
    enabled: true
http:
  addr: %s
auth:
  htpasswd:
    realm: tandem
    path: %s/htpasswd
`, dir, r.Addr, dir)
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("docker-registry", "serve", filepath.Join(dir, "config.yml"))
	logf, _ := os.Create(filepath.Join(dir, "registry.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd)
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get("http://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusUnauthorized {
				return r
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "registry.log"))
			t.Fatalf("registry did not come up: %v\n%s", err, b)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// RemoveImagesFrom removes, when the test ends (after the cleanups
// registered later: the shims and tasks that pulled), every image of the
// machine's engine named under addr: what a shim or tandem pulled from a
// test's registry (or a proxy in front of it) would otherwise stay in the
// engine, one more per run of the suite.
func RemoveImagesFrom(t testing.TB, addr string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out, err := Docker(ctx, "images", "--no-trunc", "--format", "{{.Repository}} {{.Tag}} {{.ID}}")
		if err != nil {
			t.Logf("list the images pulled from %s: %v", addr, err)
			return
		}
		// By name, so that an image also tagged otherwise only loses this
		// name; one whose tag moved on (<none>) has no other.
		var refs []string
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) != 3 || !strings.HasPrefix(f[0], addr+"/") {
				continue
			}
			ref := f[0] + ":" + f[1]
			if f[1] == "<none>" {
				ref = f[2]
			}
			if !slices.Contains(refs, ref) {
				refs = append(refs, ref)
			}
		}
		if len(refs) == 0 {
			return
		}
		if _, err := Docker(ctx, append([]string{"rmi", "-f"}, refs...)...); err != nil {
			t.Errorf("remove the images pulled from %s: %v", addr, err)
		}
	})
}

// Push tags local image as <addr>/<repo>, pushes it with the registry's
// credentials, then deletes both local tags so that a pull of the result
// has to download the image's own layers (Docker would otherwise just
// re-tag the image it already has).
func (r *Registry) Push(t testing.TB, local, repo string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ref := r.Addr + "/" + repo
	cfgDir := t.TempDir() // a private docker CLI config: no stored login leaks
	steps := [][]string{
		{"tag", local, ref},
		{"--config", cfgDir, "login", "-u", r.Username, "-p", r.Password, r.Addr},
		{"--config", cfgDir, "push", ref},
		{"rmi", ref, local},
	}
	for _, s := range steps {
		if _, err := Docker(ctx, s...); err != nil {
			t.Fatal(err)
		}
	}
	return ref
}

// FreeAddr returns a free 127.0.0.1 TCP address whose port is below the
// kernel's ephemeral range. A port from that range (what Listen(":0")
// hands out) can be taken again by anything that binds or connects
// without naming a port: Docker's embedded DNS listens on a random one in
// every container on a user-defined network, and a runner inside told to
// listen on the same number failed with "address already in use".
func FreeAddr(t testing.TB) string {
	t.Helper()
	low := ephemeralLow()
	for range 1000 {
		port := freeAddrFloor + rand.IntN(low-freeAddrFloor)
		ln, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err != nil {
			continue // in use
		}
		ln.Close()
		addr := "127.0.0.1:" + strconv.Itoa(port)
		if handedOut.claim(addr) {
			return addr
		}
	}
	t.Fatalf("no free port in %d-%d", freeAddrFloor, low-1)
	return ""
}

// freeAddrFloor is the lowest port FreeAddr hands out: above the
// well-known and the agents' default ports (10999, 10022).
const freeAddrFloor = 20000

// ephemeralLow is the first port of the kernel's ephemeral range (a new
// network namespace's when it cannot be read or leaves too few below it).
func ephemeralLow() int {
	r, err := portrange.Read(portrange.HostFile)
	if err != nil || r.Low <= freeAddrFloor+1000 {
		return portrange.NetnsDefault().Low
	}
	return r.Low
}

// portSet remembers the ports FreeAddr handed out in this test process.
// The kernel may give a port just closed to the next Listen(":0"), and
// parallel tests bind theirs later: one runner's SSH port once became
// another's HTTP port. A port is handed out once per process.
type portSet struct {
	mu   sync.Mutex
	seen map[string]bool
}

func (p *portSet) claim(addr string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.seen[addr] {
		return false
	}
	if p.seen == nil {
		p.seen = map[string]bool{}
	}
	p.seen[addr] = true
	return true
}

// handedOut is process-wide on purpose: parallel tests share the port space.
var handedOut portSet
