package task

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestRecordsLoadAndLeftovers(t *testing.T) {
	r := records{dir: t.TempDir()}
	for _, id := range []string{"a", ".hidden-id", "x/y"} {
		if err := r.save(record{Config: api.TaskConfig{ID: id, RegistryPassword: "secret"}, Status: api.TaskRunning}); err != nil {
			t.Fatal(err)
		}
	}
	leftover := filepath.Join(r.dir, ".a.json.tmp-123")
	_ = os.WriteFile(leftover, []byte("{"), 0o600)
	got, err := r.load()
	if err != nil || len(got) != 3 {
		t.Fatalf("load: %d %v", len(got), err)
	}
	for _, l := range got {
		if l.err != nil || l.rec.Config.ID != l.id || l.rec.Config.RegistryPassword != "" {
			t.Fatalf("record %+v", l)
		}
	}
	if _, err := os.Stat(leftover); !os.IsNotExist(err) {
		t.Fatal("a write cut short must be cleaned up")
	}
	if fi, _ := os.Stat(r.path("a")); fi.Mode().Perm() != 0o600 {
		t.Fatalf("record mode %v", fi.Mode())
	}
}
