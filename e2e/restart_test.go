package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// shimProc is a dstack-shim that can be killed -9 and started again on the
// same home and port.
type shimProc struct {
	t      testing.TB
	home   string
	port   string
	runner string
	spill  string   // its --state-spill-dir (a test's, not the host's /run)
	env    []string // added to the shim's environment (a private DOCKER_HOST)
	cmd    *exec.Cmd
	client *shimclient.Client
}

func newShimProc(t testing.TB, runner string) *shimProc {
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	p := &shimProc{t: t, home: t.TempDir(), spill: t.TempDir(), port: port, runner: runner}
	testenv.UnmountUnder(t, p.home)
	p.client, _ = shimclient.New("127.0.0.1:" + port)
	t.Cleanup(func() {
		p.kill9()
		ctx := context.Background()
		out, _ := testenv.Docker(ctx, "ps", "-aq", "--filter", "label=ai.dstack.shim.is-task=true", "--filter", "name=rs-")
		for _, id := range strings.Fields(out) {
			_, _ = testenv.Docker(ctx, "rm", "-f", id)
		}
	})
	return p
}

// start runs the shim and returns how long it took to serve.
func (p *shimProc) start(args ...string) time.Duration {
	p.t.Helper()
	begin := time.Now()
	argv := append([]string{"--shim-home", p.home, "--state-spill-dir", p.spill, "--shim-http-port", p.port, "--runner-binary-path", p.runner, "--shim-log-level", "debug"}, args...)
	p.cmd = exec.Command(testenv.Binaries(p.t).Shim, argv...)
	if p.env != nil {
		p.cmd.Env = append(os.Environ(), p.env...)
	}
	logf, _ := os.OpenFile(filepath.Join(p.home, "stderr"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	testenv.Isolate(p.cmd)
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	for {
		if _, err := p.client.Healthcheck(context.Background()); err == nil {
			return time.Since(begin)
		}
		if time.Since(begin) > 20*time.Second {
			b, _ := os.ReadFile(filepath.Join(p.home, "shim.log"))
			p.t.Fatalf("shim did not come back:\n%s", b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (p *shimProc) kill9() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
		p.cmd = nil
	}
}

func (p *shimProc) waitStatus(id string, ok func(api.TaskInfoResponse) bool) api.TaskInfoResponse {
	p.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var last api.TaskInfoResponse
	var err error
	for time.Now().Before(deadline) {
		last, err = p.client.GetTask(context.Background(), id)
		if err == nil && ok(last) {
			return last
		}
		time.Sleep(25 * time.Millisecond)
	}
	b, _ := os.ReadFile(filepath.Join(p.home, "shim.log"))
	p.t.Fatalf("task %s: last %+v err %v\n%s", id, last, err, tailStr(string(b), 3000))
	return last
}

// exitOnFile is a stand-in runner that runs until /ctl/exit holds its code.
const exitOnFile = `while [ ! -f /ctl/exit ]; do sleep 0.1; done; exit "$(cat /ctl/exit)"`

// exitOnFileShim is a started shim whose stand-in runner is exitOnFile, and
// the image its tasks use.
func exitOnFileShim(t *testing.T) (*shimProc, string) {
	p := newShimProc(t, runnerScript(t, exitOnFile))
	p.start()
	return p, testenv.Busybox(t)
}

// cyclesOr is n, or short under -short.
func cyclesOr(n, short int) int {
	if testing.Short() {
		return short
	}
	return n
}

// exitOnFileTask is a task for an exitOnFile runner, with the host dir whose
// "exit" file ends it.
func exitOnFileTask(t testing.TB, img, prefix string) (api.TaskConfig, string) {
	dir := t.TempDir()
	return api.TaskConfig{ID: randomID(prefix), Name: "rs-" + strings.ToLower(randomID(prefix[:1])), ImageName: img,
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: dir, Path: "/ctl"}}}, dir
}

func TestShimKill9Restart(t *testing.T) {
	const username = "tandem-e2e"
	ak := filepath.Join(hostUser(t, username), ".ssh", "authorized_keys")
	reg := testenv.StartRegistry(t)
	reg.Push(t, uniqueImage(t, 256<<10), "tandem/held:v1")
	gate, _ := blobGate(t, reg.Addr)
	p := newShimProc(t, runnerScript(t, exitOnFile))
	p.start()
	img := testenv.Busybox(t)
	ctx := context.Background()
	ctlA, ctlB := t.TempDir(), t.TempDir()
	submit := func(cfg api.TaskConfig) api.TaskConfig {
		if cfg.ImageName == "" {
			cfg.ImageName = img
		}
		cfg.Name = "rs-" + strings.ToLower(randomID("t"))
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	key := "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIRestartRestartRestartRestartRestartRest e2e"
	a := submit(api.TaskConfig{ID: randomID("a"), InstanceMounts: []api.InstanceMountPoint{{InstancePath: ctlA, Path: "/ctl"}}, HostSSHUser: username, HostSSHKeys: []string{key}})
	b := submit(api.TaskConfig{ID: randomID("b"), NetworkMode: "bridge", InstanceMounts: []api.InstanceMountPoint{{InstancePath: ctlB, Path: "/ctl"}}})
	done := t.TempDir()
	_ = os.WriteFile(filepath.Join(done, "exit"), []byte("0"), 0o644)
	c := submit(api.TaskConfig{ID: randomID("c"), InstanceMounts: []api.InstanceMountPoint{{InstancePath: done, Path: "/ctl"}}})
	d := submit(api.TaskConfig{ID: randomID("d"), ImageName: gate + "/tandem/held:v1", RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	ctlE := t.TempDir()
	e := submit(api.TaskConfig{ID: randomID("e"), InstanceMounts: []api.InstanceMountPoint{{InstancePath: ctlE, Path: "/ctl"}}})
	p.waitStatus(e.ID, running)
	ia := p.waitStatus(a.ID, running)
	ib := p.waitStatus(b.ID, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskRunning && len(i.Ports) == 2 })
	p.waitStatus(c.ID, terminated)
	p.waitStatus(d.ID, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskPulling })
	if b, _ := os.ReadFile(ak); !strings.Contains(string(b), "# tandem task "+a.ID) {
		t.Fatalf("keys not added: %s", b)
	}
	// The registry password never reaches the disk.
	if out, _ := exec.Command("grep", "-r", reg.Password, filepath.Join(p.home, "tasks")).Output(); len(out) > 0 {
		t.Fatalf("registry password persisted: %s", out)
	}

	p.kill9()
	// While the shim is down: e exits on its own, and a task container that
	// no record knows of appears (as dstack's own shim with this home
	// would leave it: unlabelled, its runner dir under the home).
	_ = os.WriteFile(filepath.Join(ctlE, "exit"), []byte("4"), 0o644)
	stray := randomID("stray")
	if _, err := testenv.Docker(ctx, "run", "-d", "--name", "rs-"+stray, "--label", "ai.dstack.shim.is-task=true",
		"--label", "ai.dstack.shim.task-id="+stray, "-v", filepath.Join(p.home, "runners", "rs-"+stray)+":/tmp/runner", img, "sleep", "300"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	serve := p.start()
	t.Logf("restart to serving: %s", serve)
	if fe := p.waitStatus(e.ID, terminated); fe.TerminationReason != api.ReasonContainerExitedWithError {
		t.Fatalf("exit while the shim was down: %+v", fe)
	}
	if st := p.waitStatus(stray, running); st.ContainerName != "rs-"+stray {
		t.Fatalf("adopted stray: %+v", st)
	}
	if _, err := p.client.TerminateTask(ctx, stray, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer}); err != nil {
		t.Fatal(err)
	}
	if err := p.client.RemoveTask(ctx, stray); err != nil {
		t.Fatal(err)
	}
	if err := p.client.RemoveTask(ctx, e.ID); err != nil {
		t.Fatal(err)
	}

	ra := p.waitStatus(a.ID, running)
	rb := p.waitStatus(b.ID, running)
	if ra.ContainerID != ia.ContainerID || rb.ContainerID != ib.ContainerID || fmt.Sprint(rb.Ports) != fmt.Sprint(ib.Ports) || ra.Ports == nil {
		t.Fatalf("re-attached tasks changed:\n a %+v -> %+v\n b %+v -> %+v", ia, ra, ib, rb)
	}
	if rc, _ := p.client.GetTask(ctx, c.ID); rc.Status != api.TaskTerminated || rc.TerminationReason != api.ReasonDoneByRunner {
		t.Fatalf("finished task after restart: %+v", rc)
	}
	rd := p.waitStatus(d.ID, terminated)
	if rd.TerminationReason != api.ReasonExecutorError || !strings.Contains(rd.TerminationMessage, "restarted before the task's container started") {
		t.Fatalf("mid-pull task: %+v", rd)
	}
	// A re-attached task's exit is still seen, with the right reason, and its
	// host keys are removed.
	_ = os.WriteFile(filepath.Join(ctlA, "exit"), []byte("3"), 0o644)
	fa := p.waitStatus(a.ID, terminated)
	if fa.TerminationReason != api.ReasonContainerExitedWithError {
		t.Fatalf("exit after restart: %+v", fa)
	}
	if b, _ := os.ReadFile(ak); strings.Contains(string(b), "# tandem task "+a.ID) {
		t.Fatalf("host key line leaked: %s", b)
	}
	fb, err := p.client.TerminateTask(ctx, b.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: 2})
	if err != nil || fb.Status != api.TaskTerminated || fb.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("terminate after restart: %+v %v", fb, err)
	}
	for _, id := range []string{a.ID, b.ID, c.ID, d.ID} {
		if err := p.client.RemoveTask(ctx, id); err != nil {
			t.Fatalf("remove %s: %v", id, err)
		}
	}
	out, _ := testenv.Docker(ctx, "ps", "-aq", "--filter", "label=ai.dstack.shim.is-task=true", "--filter", "name=rs-")
	if strings.TrimSpace(out) != "" {
		t.Fatalf("containers leaked: %s", out)
	}
	if entries, _ := os.ReadDir(filepath.Join(p.home, "tasks")); len(entries) != 0 {
		t.Fatalf("records leaked: %v", entries)
	}

	// A corrupt record: the task answers terminated with the reason.
	p.kill9()
	_ = os.WriteFile(filepath.Join(p.home, "tasks", "broken-task.json"), []byte(`{"config": {"id": "broken-ta`), 0o600)
	p.start()
	bt, err := p.client.GetTask(ctx, "broken-task")
	if err != nil || bt.Status != api.TaskTerminated || bt.TerminationReason != api.ReasonExecutorError || !strings.Contains(bt.TerminationMessage, "could not read this task's record") {
		t.Fatalf("corrupt record: %+v %v", bt, err)
	}
	if err := p.client.RemoveTask(ctx, "broken-task"); err != nil {
		t.Fatal(err)
	}
}

// 20 kill -9 / restart cycles with 5 concurrent tasks: none is lost.
func TestShimKill9Loop(t *testing.T) {
	cycles := cyclesOr(20, 3)
	p, img := exitOnFileShim(t)
	ctx := context.Background()
	ids := map[string]string{}
	for i := 0; i < 5; i++ {
		cfg, dir := exitOnFileTask(t, img, "loop")
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		ids[cfg.ID] = dir
	}
	containers := map[string]string{}
	for id := range ids {
		containers[id] = p.waitStatus(id, running).ContainerID
	}
	lost := 0
	var worst time.Duration
	for i := 0; i < cycles; i++ {
		p.kill9()
		worst = max(worst, p.start())
		for id := range ids {
			info, err := p.client.GetTask(ctx, id)
			if err != nil || info.Status != api.TaskRunning || info.ContainerID != containers[id] {
				lost++
				t.Errorf("cycle %d: task %s: %+v %v", i, id, info, err)
			}
		}
	}
	t.Logf("%d kill -9 cycles, %d tasks lost, slowest restart to serving %s", cycles, lost, worst)
	for id, dir := range ids {
		_ = os.WriteFile(filepath.Join(dir, "exit"), []byte("0"), 0o644)
		if info := p.waitStatus(id, terminated); info.TerminationReason != api.ReasonDoneByRunner {
			t.Fatalf("exit after %d restarts: %+v", cycles, info)
		}
		if err := p.client.RemoveTask(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
}

// TestShimKill9AsTaskRuns kills the shim the moment a task reads running,
// before the running step's background record write can land: the record
// may still say preparing. The restarted shim must ask Docker and re-attach
// the started container, never end the job on the record's word.
func TestShimKill9AsTaskRuns(t *testing.T) {
	cycles := cyclesOr(8, 2)
	p, img := exitOnFileShim(t)
	ctx := context.Background()
	for i := 0; i < cycles; i++ {
		cfg, dir := exitOnFileTask(t, img, "race")
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		var seen api.TaskInfoResponse
		for deadline := time.Now().Add(time.Minute); ; {
			info, err := p.client.GetTask(ctx, cfg.ID)
			if err == nil && info.Status == api.TaskRunning {
				seen = info
				break
			}
			if (err == nil && info.Status == api.TaskTerminated) || time.Now().After(deadline) {
				t.Fatalf("cycle %d: %+v %v", i, info, err)
			}
		}
		p.kill9()
		p.start()
		if info, err := p.client.GetTask(ctx, cfg.ID); err != nil || info.Status != api.TaskRunning || info.ContainerID != seen.ContainerID {
			t.Fatalf("cycle %d: the task was running when the shim died; after the restart: %+v %v", i, info, err)
		}
		_ = os.WriteFile(filepath.Join(dir, "exit"), []byte("0"), 0o644)
		if info := p.waitStatus(cfg.ID, terminated); info.TerminationReason != api.ReasonDoneByRunner {
			t.Fatalf("cycle %d: exit after the restart: %+v", i, info)
		}
		if err := p.client.RemoveTask(ctx, cfg.ID); err != nil {
			t.Fatal(err)
		}
	}
}

// BenchmarkShimRestartWith20Tasks: shim start to serving after kill -9 with
// 20 running tasks on disk (records read, containers re-attached).
func BenchmarkShimRestartWith20Tasks(b *testing.B) {
	p := newShimProc(b, runnerScript(b, exitOnFile))
	p.start()
	img := testenv.Busybox(b)
	ctx := context.Background()
	var ids []string
	for i := 0; i < 20; i++ {
		cfg := api.TaskConfig{ID: randomID("bench"), Name: "rs-" + strings.ToLower(randomID("b")), ImageName: img,
			InstanceMounts: []api.InstanceMountPoint{{InstancePath: b.TempDir(), Path: "/ctl"}}}
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			b.Fatal(err)
		}
		ids = append(ids, cfg.ID)
	}
	for _, id := range ids {
		p.waitStatus(id, running)
	}
	var total time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p.kill9()
		total += p.start()
		for _, id := range ids {
			if info, err := p.client.GetTask(ctx, id); err != nil || info.Status != api.TaskRunning {
				b.Fatalf("lost %s: %+v %v", id, info, err)
			}
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "ms-to-serving")
}

// keepFull writes into dir until stopped, as a job writing without end
// does: whatever space is freed (the shim's reserve given back) is taken
// again at once.
func keepFull(t *testing.T, dir string) (stop func()) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "job-fill"))
	if err != nil {
		t.Fatal(err)
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		n := len(buf)
		for {
			select {
			case <-quit:
				return
			default:
			}
			if _, err := f.Write(buf[:n]); err == nil {
				continue
			}
			// Down to the last block: smaller writes, then a pause.
			if n > 1 {
				n /= 2
				continue
			}
			time.Sleep(time.Millisecond)
			n = len(buf)
		}
	}()
	return func() {
		close(quit)
		<-done
		f.Close()
		_ = os.Remove(f.Name())
	}
}

// TestTerminateReasonSurvivesAFullHome (issue 39, item 4): a running task
// is terminated by the server while a job keeps the shim home full, so its
// record cannot be written; the shim is killed before space returns and
// started again after: the task reads terminated_by_server with the
// server's message (not container_exited_with_error from the stale record),
// and its record on disk says so too.
func TestTerminateReasonSurvivesAFullHome(t *testing.T) {
	p := newShimProc(t, runnerScript(t, "exec sleep 300"))
	p.home = smallShimHome(t)
	p.start()
	ctx := context.Background()
	cfg := api.TaskConfig{ID: randomID("full"), Name: "rs-" + strings.ToLower(randomID("full")), ImageName: testenv.Busybox(t)}
	if err := p.client.SubmitTask(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(cfg.ID, running)

	stop := keepFull(t, p.home)
	for freeBytes(t, p.home) > 0 {
		time.Sleep(10 * time.Millisecond)
	}
	// Another submit meanwhile spends the shim's reserve (its first record
	// is written in the space the reserve gives back, or it gets a 507).
	other := api.TaskConfig{ID: randomID("other"), Name: "rs-" + strings.ToLower(randomID("other")), ImageName: testenv.Busybox(t)}
	_ = p.client.SubmitTask(ctx, other)
	time.Sleep(200 * time.Millisecond)
	if _, err := p.client.TerminateTask(ctx, cfg.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer, TerminationMessage: "stopped by the server", Timeout: 1}); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(cfg.ID, terminated)
	time.Sleep(500 * time.Millisecond) // the shim's writes fail meanwhile
	p.kill9()
	stop()

	p.start()
	got := p.waitStatus(cfg.ID, terminated)
	if got.TerminationReason != api.ReasonTerminatedByServer || got.TerminationMessage != "stopped by the server" {
		t.Fatalf("after the restart: %s %q, want terminated_by_server", got.TerminationReason, got.TerminationMessage)
	}
	// Written back to the home once it had room.
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(p.home, "tasks", cfg.ID+".json"))
		if strings.Contains(string(b), `"termination_reason":"terminated_by_server"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record on disk: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
