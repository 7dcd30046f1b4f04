package metrics

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/procs"
)

// Recorded answers, written from the tools' formats: amd-smi monitor -vu
// --csv on two MI300X (MiB, percent), hl-smi's three queried columns on two
// Gaudi 2.
const (
	amdSMITwo = "gpu,gfx,gfx_clock,mem,mem_clock,encoder,decoder,vram_used,vram_total\n" +
		"0,87,2100,41,1300,N/A,0,24576,196592\n" +
		"1,3,132,0,900,N/A,0,283,196592\n"
	amdSMINA  = "gpu,gfx,gfx_clock,mem,mem_clock,encoder,decoder,vram_used,vram_total\n0,N/A,N/A,N/A,N/A,N/A,N/A,283,196592\n"
	hlSMITwo  = "1024, 98304, 45 %\n0, 98304, 0 %\n"
	sysfsUsed = 3 << 30
)

// host is a fixture root: the container's /dev and the host's /sys.
type host struct {
	t    *testing.T
	root string
}

func newHost(t *testing.T) *host { return &host{t: t, root: t.TempDir()} }

func (h *host) file(rel, data string) {
	h.t.Helper()
	write(h.t, h.root, rel, data)
}

// script writes an executable shell script and returns its path.
func (h *host) script(name, body string) string {
	h.t.Helper()
	p := filepath.Join(h.root, "bin", name)
	h.file("bin/"+name, "#!/bin/sh\n"+body)
	if err := os.Chmod(p, 0o755); err != nil {
		h.t.Fatal(err)
	}
	return p
}

// renderNode maps /dev/dri/renderD<minor> into the container as the shim
// does (a character device 226:minor).
func (h *host) renderNode(minor int) {
	h.t.Helper()
	p := filepath.Join(h.root, "dev", "dri", "renderD"+strconv.Itoa(minor))
	_ = os.MkdirAll(filepath.Dir(p), 0o755)
	if err := syscall.Mknod(p, syscall.S_IFCHR|0o600, 226<<8|minor); err != nil {
		h.t.Fatalf("mknod %s (the sysfs tests need root): %v", p, err)
	}
}

// amdSysfs is one amdgpu GPU in the host's sysfs, at render minor.
func (h *host) amdSysfs(minor int, used, total uint64, busy string) {
	d := "sys/class/drm/renderD" + strconv.Itoa(minor)
	h.file(d+"/dev", "226:"+strconv.Itoa(minor)+"\n")
	h.file(d+"/device/vendor", "0x1002\n")
	h.file(d+"/device/mem_info_vram_used", strconv.FormatUint(used, 10)+"\n")
	h.file(d+"/device/mem_info_vram_total", strconv.FormatUint(total, 10)+"\n")
	h.file(d+"/device/gpu_busy_percent", busy+"\n")
}

// collect runs Collect on a fixture with a cgroup v2 so only the GPU part
// varies, and returns the GPUs and what was logged.
func (h *host) collect(cfg Config, times int) ([]api.GPUMetrics, string) {
	h.t.Helper()
	h.file("proc/self/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
	h.file("proc/self/cgroup", "0::/\n")
	h.file("cg/cpu.stat", "usage_usec 1\n")
	h.file("cg/memory.current", "1\n")
	h.file("cg/memory.stat", "inactive_file 0\n")
	cfg.ProcRoot, cfg.CgroupRoot, cfg.Root = filepath.Join(h.root, "proc"), filepath.Join(h.root, "cg"), h.root
	for _, tool := range []*string{&cfg.NvidiaSMI, &cfg.AMDSMI, &cfg.HLSMI} {
		if *tool == "" {
			*tool = filepath.Join(h.root, "absent") // never this machine's PATH
		}
	}
	var logBuf bytes.Buffer
	c := New(cfg, slog.New(slog.NewTextHandler(&logBuf, nil)), nil)
	var gpus []api.GPUMetrics
	for range times {
		m, err := c.Collect(context.Background())
		if err != nil {
			h.t.Fatalf("collect: %v (never an error for GPUs)", err)
		}
		if m.GPUs == nil {
			h.t.Fatal("gpus is null on the wire; it must be []")
		}
		gpus = m.GPUs
	}
	return gpus, logBuf.String()
}

func gpu(used uint64, util int) api.GPUMetrics {
	return api.GPUMetrics{GPUMemoryUsageBytes: used, GPUUtilPercent: util}
}

func TestAMDJobMetricsFromAMDSMI(t *testing.T) {
	h := newHost(t)
	h.file("dev/kfd", "")
	smi := h.script("amd-smi", "[ \"$*\" = 'monitor -vu --csv' ] || exit 2\ncat <<'EOF'\n"+amdSMITwo+"EOF\n")
	got, log := h.collect(Config{AMDSMI: smi}, 1)
	want := []api.GPUMetrics{gpu(24576<<20, 87), gpu(283<<20, 3)}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("amd-smi: got %+v, want %+v (log %s)", got, want, log)
	}
}

func TestAMDJobMetricsFromSysfsWithoutAMDSMI(t *testing.T) {
	h := newHost(t)
	h.file("dev/kfd", "")
	// The job was given renderD136 and renderD128 (listed out of order on
	// purpose); the host has a third GPU, renderD144, whose usage is not
	// the job's. A regular file and a link under /dev/dri are not nodes
	// the shim mapped.
	h.renderNode(136)
	h.renderNode(128)
	h.amdSysfs(128, sysfsUsed, 192<<30, "87")
	h.amdSysfs(136, 0, 192<<30, "0")
	h.amdSysfs(144, 100<<30, 192<<30, "100")
	h.amdSysfs(152, 1, 192<<30, "5")
	h.file("dev/dri/renderD152", "")
	if err := os.Symlink(filepath.Join(h.root, "dev/dri/renderD128"), filepath.Join(h.root, "dev/dri/renderD160")); err != nil {
		t.Fatal(err)
	}
	h.amdSysfs(160, 7, 192<<30, "7")
	got, log := h.collect(Config{}, 1)
	want := []api.GPUMetrics{gpu(sysfsUsed, 87), gpu(0, 0)}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("sysfs: got %+v, want %+v (log %s)", got, want, log)
	}
}

func TestAMDSMIThatFailsFallsBackToSysfs(t *testing.T) {
	for name, body := range map[string]string{
		"N/A":        "cat <<'EOF'\n" + amdSMINA + "EOF\n",
		"exit 1":     "echo 'amdsmi init failed' >&2\nexit 1\n",
		"not csv":    "echo '{\"gpu\": 0}'\n",
		"over 100%":  "printf 'gpu,gfx,vram_used,vram_total\\n0,250,1,2\\n'\n",
		"used>total": "printf 'gpu,gfx,vram_used,vram_total\\n0,5,3,2\\n'\n",
	} {
		t.Run(name, func(t *testing.T) {
			h := newHost(t)
			h.file("dev/kfd", "")
			h.renderNode(128)
			h.amdSysfs(128, sysfsUsed, 192<<30, "42")
			got, log := h.collect(Config{AMDSMI: h.script("amd-smi", body)}, 3)
			if want := []api.GPUMetrics{gpu(sysfsUsed, 42)}; !reflect.DeepEqual(got, want) {
				t.Fatalf("got %+v, want sysfs's %+v (log %s)", got, want, log)
			}
			if n := strings.Count(log, "\n"); n != 1 || !strings.Contains(log, "amd-smi") {
				t.Fatalf("three collections logged %d lines, want one naming amd-smi:\n%s", n, log)
			}
		})
	}
}

func TestGaudiJobMetricsFromHLSMI(t *testing.T) {
	h := newHost(t)
	h.file("dev/accel/accel0", "")
	smi := h.script("hl-smi", "[ \"$*\" = '--query-aip=memory.used,memory.total,utilization.aip --format=csv,noheader,nounits' ] || exit 2\ncat <<'EOF'\n"+hlSMITwo+"EOF\n")
	got, log := h.collect(Config{HLSMI: smi}, 1)
	want := []api.GPUMetrics{gpu(1024<<20, 45), gpu(0, 0)}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("hl-smi: got %+v, want %+v (log %s)", got, want, log)
	}
}

func TestNoGPUSourceIsEmptyWithOneLogLine(t *testing.T) {
	for name, dev := range map[string]func(*host){
		"amd, no amd-smi, no sysfs": func(h *host) { h.file("dev/kfd", ""); h.renderNode(128) },
		"amd, sysfs out of range": func(h *host) {
			h.file("dev/kfd", "")
			h.renderNode(128)
			h.amdSysfs(128, 5, 4, "101")
		},
		"gaudi, no hl-smi":   func(h *host) { h.file("dev/accel/accel0", "") },
		"nvidia, no smi":     func(h *host) { h.file("dev/nvidiactl", "") },
		"tenstorrent":        func(h *host) { h.file("dev/tenstorrent/0", "") },
		"amd beside nothing": func(h *host) { h.file("dev/kfd", "") },
	} {
		t.Run(name, func(t *testing.T) {
			h := newHost(t)
			dev(h)
			got, log := h.collect(Config{}, 3)
			if len(got) != 0 {
				t.Fatalf("got %+v, want no GPUs", got)
			}
			if n := strings.Count(log, "\n"); n != 1 || !strings.Contains(log, "no GPU metrics") {
				t.Fatalf("three collections logged %d lines, want one:\n%s", n, log)
			}
		})
	}
	t.Run("no accelerator", func(t *testing.T) {
		got, log := newHost(t).collect(Config{}, 2)
		if len(got) != 0 || log != "" {
			t.Fatalf("a container with no accelerator: %+v, log %q", got, log)
		}
	})
}

// TestVendorOrder: an AMD iGPU's /dev/kfd beside an NVIDIA card is an
// NVIDIA job; /dev/accel beside /dev/kfd is AMD's.
func TestVendorOrder(t *testing.T) {
	for _, tc := range []struct {
		nodes []string
		want  vendor
	}{
		{[]string{"dev/kfd", "dev/nvidiactl"}, vendorNVIDIA},
		{[]string{"dev/dxg", wslNvidiaSMI}, vendorNVIDIA},
		{[]string{"dev/dxg"}, vendorNone},
		{[]string{"dev/kfd", "dev/accel/accel0"}, vendorAMD},
		{[]string{"dev/accel/accel0"}, vendorGaudi},
		{[]string{"dev/tenstorrent/0", "dev/kfd"}, vendorTenstorrent},
		{nil, vendorNone},
	} {
		h := newHost(t)
		for _, n := range tc.nodes {
			h.file(n, "")
		}
		c := New(Config{Root: h.root, NvidiaSMI: filepath.Join(h.root, "absent")}, nil, nil)
		if got := c.vendorOf(); got != tc.want {
			t.Errorf("%v: %q, want %q", tc.nodes, got, tc.want)
		}
	}
}

// TestAToolThatHangsIsBounded: amd-smi that never ends, one that prints
// without end and one whose child keeps its stdout open: each answer comes
// (from sysfs), and nothing the tool started is left running.
func TestAToolThatHangsIsBounded(t *testing.T) {
	for name, body := range map[string]string{
		"hangs":              "echo $$ > \"$0.pids\"\nsleep 1000\n",
		"prints without end": "echo $$ > \"$0.pids\"\nwhile :; do echo 'gpu,gfx,vram_used'; done\n",
		"child holds stdout": "sleep 1000 &\necho $! > \"$0.pids\"\nprintf 'gpu,gfx,vram_used\\n0,1,1\\n'\n",
	} {
		t.Run(name, func(t *testing.T) {
			h := newHost(t)
			h.file("dev/kfd", "")
			h.renderNode(128)
			h.amdSysfs(128, sysfsUsed, 192<<30, "42")
			smi := h.script("amd-smi", body)
			cfg := Config{AMDSMI: smi, ToolTimeout: 300 * time.Millisecond, ToolOutput: 4 << 10}
			if name == "child holds stdout" {
				cfg.ToolTimeout = 0 // the default, above the pipe's grace
			}
			got, log := h.collect(cfg, 1)
			if name == "child holds stdout" {
				// The tool ended with an answer: it is taken.
				if want := []api.GPUMetrics{gpu(1<<20, 1)}; !reflect.DeepEqual(got, want) {
					t.Fatalf("got %+v, want the tool's %+v (log %s)", got, want, log)
				}
			} else if want := []api.GPUMetrics{gpu(sysfsUsed, 42)}; !reflect.DeepEqual(got, want) {
				t.Fatalf("got %+v, want sysfs's %+v (log %s)", got, want, log)
			}
			b, err := os.ReadFile(smi + ".pids")
			if err != nil {
				t.Fatal(err)
			}
			pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
			// Killed processes are reaped by Wait (the tool) or, for
			// its orphaned child, by init: either way they no longer run.
			// SIGKILL is delivered when the process next runs: wait for
			// that, generously (a kill never sent never comes).
			for deadline := time.Now().Add(10 * time.Second); alive(pid); time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					_ = syscall.Kill(pid, syscall.SIGKILL)
					t.Fatalf("pid %d the tool started still runs", pid)
				}
			}
		})
	}
}

// alive reports whether pid runs (a zombie does not count).
func alive(pid int) bool {
	f, err := procs.StatFields("/proc/" + strconv.Itoa(pid))
	return err == nil && f[0] != "Z"
}

// TestOneToolRunAtATime: a request that comes while a GPU read is under
// way shares it instead of starting another amd-smi.
func TestOneToolRunAtATime(t *testing.T) {
	var f flight
	release, calls := make(chan struct{}), 0
	first := make(chan []api.GPUMetrics)
	started := make(chan struct{})
	go func() {
		first <- f.do(context.Background(), func(context.Context) []api.GPUMetrics {
			calls++
			close(started)
			<-release
			return []api.GPUMetrics{gpu(1, 1)}
		})
	}()
	<-started
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	// A caller that arrives during the run joins it; its own context ended,
	// so it gets no GPUs, and no second run was started.
	if got := f.do(gone, func(context.Context) []api.GPUMetrics { calls++; return nil }); len(got) != 0 {
		t.Fatalf("a cancelled waiter got %+v", got)
	}
	close(release)
	if got := <-first; len(got) != 1 || calls != 1 {
		t.Fatalf("first got %+v after %d runs, want 1 GPU after 1 run", got, calls)
	}
	// The run is over: the next call runs again.
	if got := f.do(context.Background(), func(context.Context) []api.GPUMetrics { calls++; return nil }); got != nil || calls != 2 {
		t.Fatalf("after the run: %+v, %d runs", got, calls)
	}
}

func TestParsersRefuseWhatIsNotTheirFormat(t *testing.T) {
	for name, tc := range map[string]struct {
		parse func([]byte) ([]api.GPUMetrics, error)
		in    string
	}{
		"amd-smi no header":       {parseAMDSMI, ""},
		"amd-smi no gfx":          {parseAMDSMI, "gpu,vram_used\n0,1\n"},
		"amd-smi gfx twice":       {parseAMDSMI, "gfx,gfx,vram_used\n1,2,3\n"},
		"amd-smi short row":       {parseAMDSMI, "gpu,gfx,vram_used\n0,1\n"},
		"amd-smi no rows":         {parseAMDSMI, "gpu,gfx,vram_used\n"},
		"amd-smi negative":        {parseAMDSMI, "gpu,gfx,vram_used\n0,-1,1\n"},
		"amd-smi MiB overflow":    {parseAMDSMI, "gpu,gfx,vram_used\n0,1,18446744073709551615\n"},
		"hl-smi two fields":       {parseHLSMI, "1024, 45\n"},
		"hl-smi used above total": {parseHLSMI, "2048, 1024, 45\n"},
		"hl-smi N/A":              {parseHLSMI, "N/A, 1024, 45\n"},
		"hl-smi 101%":             {parseHLSMI, "1, 1024, 101 %\n"},
		"hl-smi empty":            {parseHLSMI, ""},
	} {
		if got, err := tc.parse([]byte(tc.in)); !errors.Is(err, errParse) {
			t.Errorf("%s: %+v, %v; want errParse", name, got, err)
		}
	}
	// nvidia-smi's reader skips a line it cannot read, as it always did.
	got, err := parseNvidiaSMI([]byte("1024, 87\n[N/A], [N/A]\n5, 101\n-1, 5\n2, 3\n"))
	if want := []api.GPUMetrics{gpu(1<<30, 87), gpu(2<<20, 3)}; err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("nvidia-smi: %+v %v, want %+v", got, err, want)
	}
}

// TestAToolAJobUserCouldPlantIsNotRun: the runner runs vendor tools as root;
// one owned by another account, or in a directory another account may
// write, could be a job user's way to root in its container.
func TestAToolAJobUserCouldPlantIsNotRun(t *testing.T) {
	for name, plant := range map[string]func(h *host, smi string){
		"owned by a job user": func(h *host, smi string) {
			if err := os.Lchown(smi, 1000, 1000); err != nil {
				t.Fatal(err)
			}
		},
		"writable by its group": func(h *host, smi string) {
			if err := os.Chmod(smi, 0o775); err != nil {
				t.Fatal(err)
			}
		},
		"in a directory all may write": func(h *host, smi string) {
			if err := os.Chmod(filepath.Dir(smi), 0o777); err != nil {
				t.Fatal(err)
			}
		},
		"a link to a job user's file": func(h *host, smi string) {
			other := filepath.Join(h.root, "home", "amd-smi")
			h.file("home/amd-smi", "#!/bin/sh\ntouch \"$0.ran\"\n")
			if err := os.Chmod(other, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(filepath.Dir(other), 1000, 1000); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(smi); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(other, smi); err != nil {
				t.Fatal(err)
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			h := newHost(t)
			h.file("dev/kfd", "")
			h.renderNode(128)
			h.amdSysfs(128, sysfsUsed, 192<<30, "42")
			smi := h.script("amd-smi", "touch \"$0.ran\"\ncat <<'EOF'\n"+amdSMITwo+"EOF\n")
			plant(h, smi)
			got, log := h.collect(Config{AMDSMI: smi}, 2)
			if want := []api.GPUMetrics{gpu(sysfsUsed, 42)}; !reflect.DeepEqual(got, want) {
				t.Fatalf("got %+v, want sysfs's %+v (log %s)", got, want, log)
			}
			ran, _ := filepath.Glob(filepath.Join(h.root, "*", "amd-smi.ran"))
			if len(ran) != 0 {
				t.Fatalf("the planted tool ran: %v", ran)
			}
			if n := strings.Count(log, "\n"); n != 1 || !strings.Contains(log, "not run") {
				t.Fatalf("two collections logged %d lines, want one saying the tool is not run:\n%s", n, log)
			}
		})
	}
}

// TestADevDriFilledByTheJobIsReadBounded: the job may make any number of
// nodes in its own /dev/dri; the runner reads a bounded part and logs one
// short line.
func TestADevDriFilledByTheJobIsReadBounded(t *testing.T) {
	h := newHost(t)
	h.file("dev/kfd", "")
	for i := range 5000 {
		h.file("dev/dri/renderD"+strconv.Itoa(1000+i), "")
	}
	got, log := h.collect(Config{}, 2)
	if len(got) != 0 || strings.Count(log, "\n") != 1 || len(log) > 2048 {
		t.Fatalf("got %+v; log (%d bytes) %s", got, len(log), log)
	}
}
