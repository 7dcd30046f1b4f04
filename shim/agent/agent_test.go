package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/task"
)

// TestRunWithoutDocker runs the whole agent on a host whose Docker does
// not answer: the API serves, says the instance is unhealthy and why, and
// the shim stops cleanly on its context, with its log in its home.
func TestRunWithoutDocker(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-docker.sock"))
	home := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addrc := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Home: home, HTTPAddress: "127.0.0.1", HTTPPort: 0, LogLevel: logging.LevelTrace,
			Task:        task.Config{RunnerBinary: filepath.Join(home, "no-runner"), VolumesRoot: filepath.Join(home, "volumes")},
			GCPDiskByID: filepath.Join(home, "by-id"), Ready: func(a string) { addrc <- a }})
	}()
	var addr string
	select {
	case addr = <-addrc:
	case err := <-done:
		t.Fatalf("Run returned before serving: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the API never served")
	}
	get := func(path string, into any) int {
		t.Helper()
		r, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		if into != nil {
			if err := json.NewDecoder(r.Body).Decode(into); err != nil {
				t.Fatalf("%s: %v", path, err)
			}
		}
		return r.StatusCode
	}
	var hc api.HealthcheckResponse
	if code := get("/api/healthcheck", &hc); code != http.StatusOK || hc.Service != "dstack-shim" {
		t.Fatalf("healthcheck: %d %+v", code, hc)
	}
	var health api.InstanceHealthResponse
	if code := get("/api/instance/health", &health); code != http.StatusOK || health.DCGM == nil || health.DCGM.OverallHealth != api.HealthFail {
		t.Fatalf("health with Docker down: %d %+v", code, health.DCGM)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
	b, err := os.ReadFile(filepath.Join(home, "shim.log"))
	if err != nil || !bytes.Contains(b, []byte("dstack-shim stopped")) || !bytes.Contains(b, []byte("no runner binary: every task fails until there is one")) {
		t.Fatalf("shim.log: %v\n%s", err, b)
	}
}

// TestRunStopsWhatStartedWhenAStepFails: a port that is taken fails the
// API step; the engine started before it is stopped (its records synced,
// its last log line written) and Run says why.
func TestRunStopsWhatStartedWhenAStepFails(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-docker.sock"))
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	home := t.TempDir()
	err = Run(context.Background(), Config{Home: home, HTTPAddress: "127.0.0.1", HTTPPort: port,
		Task:        task.Config{RunnerBinary: filepath.Join(home, "no-runner"), VolumesRoot: filepath.Join(home, "volumes")},
		GCPDiskByID: filepath.Join(home, "by-id")})
	if err == nil || !strings.Contains(err.Error(), "listen") {
		t.Fatalf("Run with its port taken: %v", err)
	}
	b, rerr := os.ReadFile(filepath.Join(home, "shim.log"))
	if rerr != nil || !bytes.Contains(b, []byte("dstack-shim stopped")) {
		t.Fatalf("the engine was not stopped:\n%s", b)
	}
}
