package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// serverHealth is what the dstack server (511c318) makes of a shim's
// /api/instance/health answer, restated from its Python:
//   - services/runner/client.py:411-419 and :650-651 parse the body as
//     schemas/runner.py:131-132 InstanceHealthResponse (extra keys ignored;
//     dcgm optional), whose schemas/health/dcgm.py:28-59 requires
//     overall_health and incidents, and in each incident system, health,
//     error_message, error_code, entity_group_id and entity_id; health
//     values must be DCGMHealthResult's (dcgm.py:14-16: 0, 10, 20), else
//     the check fails to parse;
//   - schemas/instances.py:32-37: no dcgm is healthy, else overall_health
//     maps through dcgm.py:18-25 (0 healthy, 10 warning, 20 failure);
//   - services/runner/client.py:707-711: the message shown is the first
//     incident's error_message;
//   - services/instances.py:653: an instance whose health is a failure is
//     not offered to a job.
type serverHealth struct {
	status      string // healthy, warning, failure
	message     string
	schedulable bool
}

func dstackServerReads(body []byte) (serverHealth, error) {
	var resp map[string]json.RawMessage
	if err := json.Unmarshal(body, &resp); err != nil {
		return serverHealth{}, err
	}
	raw, ok := resp["dcgm"]
	if !ok || string(raw) == "null" {
		return serverHealth{status: "healthy", schedulable: true}, nil
	}
	var dcgm map[string]json.RawMessage
	if err := json.Unmarshal(raw, &dcgm); err != nil {
		return serverHealth{}, fmt.Errorf("dcgm: %w", err)
	}
	status := map[int]string{0: "healthy", 10: "warning", 20: "failure"}
	result := func(raw json.RawMessage, ok bool) (string, error) {
		var v int
		if !ok {
			return "", fmt.Errorf("field required")
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return "", err
		}
		s, ok := status[v]
		if !ok {
			return "", fmt.Errorf("%d is not a DCGMHealthResult", v)
		}
		return s, nil
	}
	overall, err := result(dcgm["overall_health"], dcgm["overall_health"] != nil)
	if err != nil {
		return serverHealth{}, fmt.Errorf("overall_health: %w", err)
	}
	var incidents []map[string]json.RawMessage
	if dcgm["incidents"] == nil {
		return serverHealth{}, fmt.Errorf("incidents: field required")
	}
	if err := json.Unmarshal(dcgm["incidents"], &incidents); err != nil || incidents == nil {
		return serverHealth{}, fmt.Errorf("incidents: not a list: %v", err)
	}
	out := serverHealth{status: overall, schedulable: overall != "failure"}
	for i, in := range incidents {
		if _, err := result(in["health"], in["health"] != nil); err != nil {
			return serverHealth{}, fmt.Errorf("incident %d health: %w", i, err)
		}
		for _, f := range []string{"system", "error_code", "entity_group_id", "entity_id"} {
			var v int
			if in[f] == nil || json.Unmarshal(in[f], &v) != nil {
				return serverHealth{}, fmt.Errorf("incident %d %s: an int is required", i, f)
			}
		}
		var msg string
		if in["error_message"] == nil || json.Unmarshal(in["error_message"], &msg) != nil {
			return serverHealth{}, fmt.Errorf("incident %d error_message: a string is required", i)
		}
		if i == 0 {
			out.message = msg
		}
	}
	return out, nil
}

func TestDstackServerReadsHealth(t *testing.T) {
	inc := func(health int, msg string) string {
		return fmt.Sprintf(`{"system":512,"health":%d,"error_message":%q,"error_code":0,"entity_group_id":1,"entity_id":3}`, health, msg)
	}
	for _, tc := range []struct {
		name, body string
		want       serverHealth
		err        bool
	}{
		{"null", `{"dcgm":null}`, serverHealth{status: "healthy", schedulable: true}, false},
		{"no key", `{}`, serverHealth{status: "healthy", schedulable: true}, false},
		{"pass", `{"dcgm":{"overall_health":0,"incidents":[]}}`, serverHealth{status: "healthy", schedulable: true}, false},
		{"a GPU out, host a warning", `{"dcgm":{"overall_health":10,"incidents":[` + inc(20, "GPU 3: XID 79") + `]}}`,
			serverHealth{status: "warning", message: "GPU 3: XID 79", schedulable: true}, false},
		{"host failure", `{"dcgm":{"overall_health":20,"incidents":[` + inc(20, "no NVML") + `,` + inc(10, "GPU 1: hot") + `]}}`,
			serverHealth{status: "failure", message: "no NVML"}, false},
		{"extra keys ignored", `{"dcgm":{"overall_health":20,"incidents":[],"tandem":1},"x":2}`, serverHealth{status: "failure"}, false},
		{"health outside the enum", `{"dcgm":{"overall_health":15,"incidents":[]}}`, serverHealth{}, true},
		{"incident health outside the enum", `{"dcgm":{"overall_health":20,"incidents":[` + inc(30, "x") + `]}}`, serverHealth{}, true},
		{"incidents missing", `{"dcgm":{"overall_health":20}}`, serverHealth{}, true},
		{"incidents null", `{"dcgm":{"overall_health":20,"incidents":null}}`, serverHealth{}, true},
		{"incident field missing", `{"dcgm":{"overall_health":20,"incidents":[{"health":20,"error_message":"x"}]}}`, serverHealth{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := dstackServerReads([]byte(tc.body))
			if (err != nil) != tc.err || got != tc.want {
				t.Fatalf("got %+v %v, want %+v (error %v)", got, err, tc.want, tc.err)
			}
		})
	}
}

// TestHostWithGPUNodesButNoNVMLSaysSo (issue 66, item 5): the real shim on a
// host root whose /dev has NVIDIA GPU nodes, where NVML cannot be loaded
// (this machine has no NVIDIA driver), answers a health the dstack server
// reads as a failure and does not schedule onto, its message saying what
// to fix; with no nodes, the answer is null and the host healthy.
func TestHostWithGPUNodesButNoNVMLSaysSo(t *testing.T) {
	for _, tc := range []struct {
		name  string
		nodes []string
		want  serverHealth
		words []string
	}{
		{"nodes", []string{"nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"}, serverHealth{status: "failure"},
			// On a machine with one NVIDIA GPU, NVML answers, with fewer GPUs than
			// the fixture's nodes: a failure too, worded so.
			[]string{"2 NVIDIA GPU device nodes (/dev/nvidia0 to /dev/nvidia1) but NVML", "nvidia-smi", "restart dstack-shim"}},
		{"no nodes", nil, serverHealth{status: "healthy", schedulable: true}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			if err := os.MkdirAll(filepath.Join(root, "dev"), 0o755); err != nil {
				t.Fatal(err)
			}
			for _, n := range tc.nodes {
				if err := os.WriteFile(filepath.Join(root, "dev", n), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			h := startShim(t, testenv.Binaries(t).Runner, nil, "--host-root", root)
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, strings.TrimSuffix(h.client.BaseURL(), "/")+"/api/instance/health", nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			got, err := dstackServerReads(body)
			if err != nil {
				t.Fatalf("the server cannot parse %s: %v", body, err)
			}
			if got.status != tc.want.status || got.schedulable != tc.want.schedulable {
				t.Fatalf("the server reads %+v from %s", got, body)
			}
			for _, w := range tc.words {
				if !strings.Contains(got.message, w) {
					t.Fatalf("the message %q lacks %q", got.message, w)
				}
			}
			t.Logf("%s: %s", tc.name, body)
		})
	}
}
