package task

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

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

// A spilled record stands in for the home's only when newer; an older one
// (the home write landed, the shim died before the spill went) is dropped;
// a newer one is written home at load.
func TestSpilledRecordNewerWins(t *testing.T) {
	at := time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return at }
	r := records{dir: t.TempDir(), spill: t.TempDir(), now: clock}
	running := record{Config: api.TaskConfig{ID: "a/b"}, Status: api.TaskRunning}
	if err := r.save(running); err != nil {
		t.Fatal(err)
	}
	// An older spill than the home's: dropped.
	old := running
	old.Status, old.SavedAt = api.TaskPending, at.Add(-time.Second)
	b, _ := json.Marshal(old)
	if err := r.spillWrite("a/b", b); err != nil {
		t.Fatal(err)
	}
	ls, err := r.load()
	if err != nil || len(ls) != 1 || ls[0].rec.Status != api.TaskRunning {
		t.Fatalf("older spill: %+v %v", ls, err)
	}
	if _, err := os.Stat(r.spillPath("a/b")); !os.IsNotExist(err) {
		t.Fatalf("older spill kept: %v", err)
	}
	// A newer one: it wins, is written home, and goes.
	newer := running
	newer.Status, newer.Reason, newer.SavedAt = api.TaskTerminated, api.ReasonTerminatedByServer, at.Add(time.Second)
	b, _ = json.Marshal(newer)
	if err := r.spillWrite("a/b", b); err != nil {
		t.Fatal(err)
	}
	at = at.Add(2 * time.Second)
	ls, err = r.load()
	if err != nil || len(ls) != 1 || ls[0].rec.Reason != api.ReasonTerminatedByServer {
		t.Fatalf("newer spill: %+v %v", ls, err)
	}
	home, _ := readRecords(r.dir)
	if len(home) != 1 || home[0].rec.Reason != api.ReasonTerminatedByServer {
		t.Fatalf("not written home: %+v", home)
	}
	if _, err := os.Stat(r.spillPath("a/b")); !os.IsNotExist(err) {
		t.Fatalf("spill kept after the write home: %v", err)
	}
}

// A version 1 record (what a task held in top-level fields) reads back in
// the version 2 shape, and is written back as version 2 only.
func TestRecordV1ReadsBack(t *testing.T) {
	r := records{dir: t.TempDir()}
	v1 := `{"version":1,"config":{"id":"a","name":"n"},"status":"terminated","termination_reason":"done_by_runner",
		"termination_message":"","container_name":"n-1","container_id":"c1","ports":[{"host":1,"container":2}],
		"gpu_ids":["g0"],"keys_added":true,"volumes":["v1"],"released":false,"holds":["volumes"],"no_container":true}`
	if err := os.MkdirAll(r.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(r.path("a"), []byte(v1), 0o600); err != nil {
		t.Fatal(err)
	}
	ls, err := r.load()
	if err != nil || len(ls) != 1 || ls[0].err != nil {
		t.Fatalf("load: %+v %v", ls, err)
	}
	want := held{Container: heldContainer{Name: "n-1", ID: "c1", Ports: []api.PortMapping{{Host: 1, Container: 2}}, None: true},
		GPUs: []string{"g0"}, HostKeys: true, Volumes: []string{"v1"}}
	if got := ls[0].rec.Held; !reflect.DeepEqual(got, want) {
		t.Fatalf("held %+v, want %+v", got, want)
	}
	if err := r.save(ls[0].rec); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(r.path("a"))
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	if string(raw["version"]) != "2" || raw["held"] == nil {
		t.Fatalf("written back: %s", b)
	}
	// A shim of before version 2 (a downgrade) reads version 1's fields:
	// they are written too, from held.
	var old recordV1
	if err := json.Unmarshal(b, &old); err != nil || !reflect.DeepEqual(old.held(), want) {
		t.Fatalf("version 1's fields as written: %+v %v (%s)", old, err, b)
	}
	ls, err = r.load()
	if err != nil || len(ls) != 1 || !reflect.DeepEqual(ls[0].rec.Held, want) || !slices.Equal(ls[0].rec.Holds, []string{"volumes"}) {
		t.Fatalf("version 2 read back: %+v %v", ls, err)
	}
}
