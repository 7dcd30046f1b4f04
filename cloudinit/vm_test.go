package cloudinit

import (
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

func gunzipBase64(t *testing.T, s string) string {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	out, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func sampleVM() VM {
	return VM{ShimURL: "https://example.com/tandem/0.1.0/dstack-shim-linux-amd64", RunnerURL: "https://example.com/tandem/0.1.0/dstack-runner-linux-amd64",
		ShimSHA256: strings.Repeat("cd", 32), RunnerSHA256: strings.Repeat("ef", 32),
		Firewall: true, AuthorizedKeys: []string{testKey}, Env: map[string]string{"HF_HOME": "/data/hf"}}
}

func TestUserDataValidCloudConfig(t *testing.T) {
	ud, err := sampleVM().UserData()
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "user-data.yaml", ud)
	if !strings.HasPrefix(ud, "#cloud-config\n") {
		t.Fatal("header")
	}
	var cc cloudConfig
	if err := yaml.Unmarshal([]byte(ud), &cc); err != nil || len(cc.WriteFiles) != 5 {
		t.Fatalf("round trip: %v %+v", err, cc)
	}
	// Docker's data root mover and its boot unit, as embedded.
	if cc.WriteFiles[3].Path != dataRootBin || cc.WriteFiles[3].Encoding != "gz+b64" || gunzipBase64(t, cc.WriteFiles[3].Content) != dataRootScript || cc.WriteFiles[4].Path != dataRootFile {
		t.Fatalf("data root files: %s %s", cc.WriteFiles[3].Path, cc.WriteFiles[4].Path)
	}
	shellcheck(t, dataRootScript, "bash")
	// EC2 refuses user data over 16 KiB.
	if len(ud) > 16<<10 {
		t.Fatalf("user data is %d bytes, above EC2's 16 KiB", len(ud))
	}
	keep := sampleVM()
	keep.KeepDockerDataRoot = true
	if kept, _ := keep.UserData(); strings.Contains(kept, dataRootBin) {
		t.Fatal("--keep-docker-data-root still moves it")
	}
	if cc.WriteFiles[0].Path != installBin || cc.WriteFiles[0].Encoding != "gz+b64" {
		t.Fatalf("installer file: %+v", cc.WriteFiles[0])
	}
	inst := gunzipBase64(t, cc.WriteFiles[0].Content)
	shellcheck(t, inst, "bash")
	for _, want := range []string{"DSTACK_SHIM_HOME=\"/root/.dstack\"", "DSTACK_RUNNER_DOWNLOAD_URL=\"https://example.com/tandem/0.1.0/dstack-runner-linux-amd64\"", "HF_HOME=\"/data/hf\""} {
		if !strings.Contains(cc.WriteFiles[1].Content, want) {
			t.Fatalf("env file misses %s:\n%s", want, cc.WriteFiles[1].Content)
		}
	}
	if !strings.Contains(inst, "ufw allow from 172.16.0.0/12") || !strings.Contains(inst, "sha256sum -c") {
		t.Fatalf("installer:\n%s", inst)
	}
	if _, err := exec.LookPath("cloud-init"); err != nil {
		t.Skip("cloud-init not installed (make deps installs it)")
	}
	f := filepath.Join(t.TempDir(), "user-data")
	_ = os.WriteFile(f, []byte(ud), 0o644)
	if out, err := exec.Command("cloud-init", "schema", "--config-file", f).CombinedOutput(); err != nil || !strings.Contains(string(out), "Valid") {
		t.Fatalf("cloud-init schema: %v\n%s", err, out)
	}
}

func TestScriptAndUnit(t *testing.T) {
	v := sampleVM()
	v.Baked, v.ShimURL, v.RunnerURL = true, "", ""
	s, err := v.Script()
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "startup.sh", s)
	shellcheck(t, s, "bash")
	if !strings.Contains(s, "is not baked into this image") || strings.Contains(s, "fetch '") {
		t.Fatalf("baked images use their binaries:\n%s", s)
	}
	for _, want := range []string{"Restart=always", "ConditionFileIsExecutable=/usr/local/bin/dstack-shim", "StartLimitBurst=20", "After=network-online.target docker.service", "EnvironmentFile=/etc/dstack/shim.env"} {
		if !strings.Contains(unit, want) {
			t.Fatalf("unit misses %s", want)
		}
	}
	if _, err := exec.LookPath("systemd-analyze"); err != nil && os.Getenv("CI") == "true" {
		t.Fatal("systemd-analyze missing (make deps installs systemd)")
	} else if err == nil {
		dir := t.TempDir()
		p := filepath.Join(dir, "dstack-shim.service")
		_ = os.WriteFile(p, []byte(unit), 0o644)
		out, _ := exec.Command("systemd-analyze", "verify", p).CombinedOutput()
		// The binary is not installed here; anything else is a unit error.
		for _, line := range strings.Split(string(out), "\n") {
			if line != "" && !strings.Contains(line, shimBin) && !strings.Contains(line, "docker.service") {
				t.Fatalf("systemd-analyze verify: %s", out)
			}
		}
	}
}

func TestVMBadInput(t *testing.T) {
	tests := []struct {
		mod  func(*VM)
		want string
	}{
		{func(v *VM) { v.ShimURL = "" }, "shim_url: required"},
		{func(v *VM) { v.RunnerURL = "file:///x" }, "runner_url: "},
		{func(v *VM) { v.ShimSHA256 = "abc" }, "shim_sha256: "},
		{func(v *VM) { v.AuthorizedKeys = []string{"ssh-rsa nope"} }, "authorized_keys[0]: "},
		{func(v *VM) { v.AllowCIDRs = []string{"10.0.0.0/33"} }, "allow_cidrs: "},
		{func(v *VM) { v.Env = map[string]string{"1BAD": "x"} }, `env: "1BAD"`},
		{func(v *VM) { v.Env = map[string]string{"OK": "a\"b"} }, "env OK: "},
		{func(v *VM) { v.ShimHome = "relative" }, "shim_home: "},
		{func(v *VM) { v.LogLevel = "loud!" }, "log_level: "},
	}
	for _, tc := range tests {
		v := sampleVM()
		tc.mod(&v)
		if _, err := v.UserData(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want %q, got %v", tc.want, err)
		}
	}
}

// The unit Packer bakes in is the one cloud-init writes.
func TestPackerUnitIsTheSame(t *testing.T) {
	path := filepath.Join("..", "packer", "files", "dstack-shim.service")
	if *update {
		_ = os.WriteFile(path, []byte(unit), 0o644)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != unit {
		t.Fatalf("%s differs from cloudinit's unit (go test ./cloudinit -update): %v", path, err)
	}
	env, err := os.ReadFile(filepath.Join("..", "packer", "files", "shim.env"))
	if err != nil {
		t.Fatal(err)
	}
	baked := VM{Baked: true}
	baked.defaults()
	if string(env) != baked.envLines() {
		t.Fatalf("packer/files/shim.env differs from a baked VM's env:\n%s\nwant:\n%s", env, baked.envLines())
	}
}

// The installer is one script that fails loudly: a missing downloader, a
// missing Docker or a binary that does not run stop it before the unit is
// enabled; --install-docker installs Docker with apt.
func TestInstallerFailsLoudly(t *testing.T) {
	v := sampleVM()
	ud, err := v.UserData()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(ud, "runcmd:\n    - - /usr/local/lib/tandem/install-agents.sh\n") {
		t.Fatalf("runcmd must be the installer alone:\n%s", ud)
	}
	inst, err := v.installer()
	if err != nil {
		t.Fatal(err)
	}
	shellcheck(t, inst, "bash")
	enable := strings.Index(inst, "systemctl enable --now dstack-shim.service")
	for _, before := range []string{"fetch '", "runs /usr/local/bin/dstack-shim"} {
		if i := strings.Index(inst, before); i < 0 || i > enable {
			t.Fatalf("%q must come before the unit is enabled:\n%s", before, inst)
		}
	}
	for _, want := range []string{"neither curl nor wget", "logger -p user.err -t tandem-install", "Docker is not installed", "glibc 2.31"} {
		if !strings.Contains(inst, want) {
			t.Fatalf("installer lacks %q", want)
		}
	}
	if strings.Contains(inst, "apt-get -q -y install docker.io") {
		t.Fatal("Docker is installed only when asked")
	}
	v.InstallDocker = true
	inst, err = v.installer()
	if err != nil {
		t.Fatal(err)
	}
	shellcheck(t, inst, "bash")
	if !strings.Contains(inst, "apt-get -q -y install docker.io") || !strings.Contains(inst, "APT::Update::Error-Mode=any") {
		t.Fatalf("--install-docker:\n%s", inst)
	}
}

// The installer sets up Docker's pulls: pigz (unpigz) installed where
// apt-get is, and max-concurrent-downloads 8 in daemon.json unless the
// operator set one; its daemon.json edit keeps the rest and never
// writes over a file it cannot read.
func TestInstallerSetsUpDockerPulls(t *testing.T) {
	v := sampleVM()
	inst, err := v.installer()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(inst, "apt-get -q -y install pigz") || strings.Index(inst, "install pigz") > strings.Index(inst, "systemctl enable --now dstack-shim.service") {
		t.Fatalf("installer does not install pigz before the shim starts:\n%s", inst)
	}
	v.InstallDocker = true
	if withDocker, _ := v.installer(); !strings.Contains(withDocker, "apt-get -q -y install docker.io pigz") {
		t.Fatal("--install-docker does not install pigz with Docker")
	}
	_, rest, ok := strings.Cut(inst, "python3 - /etc/docker/daemon.json <<'PY' || pulls=$?\n")
	py, _, ok2 := strings.Cut(rest, "\nPY\n")
	if !ok || !ok2 {
		t.Fatalf("no daemon.json edit in the installer:\n%s", inst)
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	edit := func(path string) int {
		cmd := exec.Command("python3", "-", path)
		cmd.Stdin = strings.NewReader(py)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatalf("%v %s", err, out)
		}
		return 0
	}
	dir := t.TempDir()
	for _, c := range []struct {
		name, before, after string
		rc                  int
	}{
		{"absent", "", `{"max-concurrent-downloads":8}`, 0},
		{"other settings kept", `{"live-restore": true, "data-root": "/opt/d"}`, `{"data-root":"/opt/d","live-restore":true,"max-concurrent-downloads":8}`, 0},
		{"the operator's value kept", `{"max-concurrent-downloads": 3}`, `{"max-concurrent-downloads": 3}`, 3},
		{"unreadable left alone", `{"live-restore": tru`, `{"live-restore": tru`, 1},
	} {
		p := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".json")
		if c.before != "" {
			if err := os.WriteFile(p, []byte(c.before), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if rc := edit(p); rc != c.rc {
			t.Fatalf("%s: exit %d, want %d", c.name, rc, c.rc)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		got := string(b)
		if c.rc == 0 {
			var m map[string]any
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatalf("%s: %v %s", c.name, err, b)
			}
			nb, _ := json.Marshal(m)
			got = string(nb)
		}
		if got != c.after {
			t.Fatalf("%s: daemon.json %s, want %s", c.name, got, c.after)
		}
		if _, err := os.Stat(p + ".tandem"); err == nil {
			t.Fatalf("%s: temporary file left", c.name)
		}
	}
}
