package gpu

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

const exposition = `# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaa"} 10

DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-bbb"} 90
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaa"} 100
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-bbb"} 200
# a stray comment
`

func TestExporterProxyFilters(t *testing.T) {
	hits := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits++
		_, _ = io.WriteString(w, exposition)
	}))
	defer srv.Close()
	now := time.Unix(0, 0)
	e := &Exporter{URL: srv.URL, Interval: 5 * time.Second, Now: func() time.Time { return now }}
	text, err := e.Fetch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got := FilterExposition(text, []string{"GPU-bbb"})
	want := "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n" +
		"DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-bbb\"} 90\n" +
		"# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n# TYPE DCGM_FI_DEV_FB_USED gauge\n" +
		"DCGM_FI_DEV_FB_USED{gpu=\"1\",UUID=\"GPU-bbb\"} 200\n"
	if got != want {
		t.Fatalf("got:\n%s\nwant:\n%s", got, want)
	}
	if FilterExposition(text, nil) != "" {
		t.Fatal("no GPUs, empty body")
	}
	_, _ = e.Fetch(context.Background())
	if hits != 1 {
		t.Fatal("fetched twice within the interval")
	}
	now = now.Add(6 * time.Second)
	_, _ = e.Fetch(context.Background())
	if hits != 2 {
		t.Fatal("a new interval fetches again")
	}
	srv.Close()
	now = now.Add(6 * time.Second)
	if _, err := e.Fetch(context.Background()); err == nil {
		t.Fatal("a dead exporter is an error (502 upstream)")
	}
}
