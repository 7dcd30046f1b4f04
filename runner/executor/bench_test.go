package executor

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// BenchmarkJobOutput: a job cats 64 MiB of 100-byte lines through the pty
// while a pull loop collects them as the server would; MB/s is delivered
// output.
func BenchmarkJobOutput(b *testing.B) {
	const size = 64 << 20
	file := filepath.Join(b.TempDir(), "big")
	if out, err := exec.Command("sh", "-c", fmt.Sprintf(`yes "$(printf '%%099d' 0)" | head -c %d > %s`, size, file)).CombinedOutput(); err != nil {
		b.Fatalf("%v %s", err, out)
	}
	b.SetBytes(size)
	for i := 0; i < b.N; i++ {
		x, err := New(Config{TempDir: b.TempDir()})
		if err != nil {
			b.Fatal(err)
		}
		wd := b.TempDir()
		_ = x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"cat", file}, WorkingDir: &wd, RepoDir: &wd}})
		if _, _, err := x.Run(); err != nil {
			b.Fatal(err)
		}
		var ts, got int64
		for {
			p, err := x.Pull(ts)
			if err != nil {
				b.Fatal(err)
			}
			for _, l := range p.JobLogs {
				got += int64(len(l.Message))
			}
			ts = p.LastUpdated
			if !p.HasMore {
				break
			}
			if len(p.JobLogs) == 0 {
				time.Sleep(20 * time.Millisecond)
			}
		}
		if got < size {
			b.Fatalf("delivered %d of %d", got, size)
		}
		x.Close()
		os.Remove(file + ".x")
	}
}
