package task

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
)

// record is a task's durable state: enough to answer for it, re-attach to
// its container and clean up after it when the shim restarts.
type record struct {
	Version int            `json:"version"`
	Config  api.TaskConfig `json:"config"` // registry password removed
	// PasswordHash is a salted hash of the registry password, so that an
	// identical re-submit after a restart is recognised without the
	// password ever reaching the disk.
	PasswordHash string                `json:"registry_password_hash,omitempty"`
	Status       api.TaskStatus        `json:"status"`
	Reason       api.TerminationReason `json:"termination_reason"`
	Message      string                `json:"termination_message"`
	// Held is what the task holds, each kind of its list its own part
	// (resource.go), in one place of the record.
	Held        held                      `json:"held"`
	Released    bool                      `json:"released"`        // every resource given back (resource.go)
	Holds       []string                  `json:"holds,omitempty"` // kinds whose release failed: retried, at the next start too
	StopRequest *api.TaskTerminateRequest `json:"stop_request,omitempty"`
	SubmittedAt time.Time                 `json:"submitted_at,omitzero"`
	Job         *api.JobStateEvent        `json:"job,omitempty"` // the job's final state
	// SavedAt orders a record and its spilled copy (the newer wins).
	SavedAt time.Time `json:"saved_at,omitzero"`
}

// recordVersion 2 keeps what the task holds under "held"; version 1 had
// it in top-level fields (recordV1), read back by readRecords.
const recordVersion = 2

// recordV1 is where a version 1 record kept what its task held.
type recordV1 struct {
	ContainerName string            `json:"container_name"`
	ContainerID   string            `json:"container_id"`
	Ports         []api.PortMapping `json:"ports"`
	GPUIDs        []string          `json:"gpu_ids"`
	KeysAdded     bool              `json:"keys_added"`
	Volumes       []string          `json:"volumes,omitempty"`
	NoContainer   bool              `json:"no_container,omitempty"`
}

// v1Of is h in version 1's fields. A record carries them beside "held",
// written from it and never read back by this shim: a shim of before
// version 2, run again after a downgrade, reads what each task holds
// there (it ignores "held"), so it still locks the GPUs, removes the key
// lines and unmounts the volumes of the tasks it finds.
func v1Of(h held) recordV1 {
	return recordV1{ContainerName: h.Container.Name, ContainerID: h.Container.ID, Ports: h.Container.Ports,
		GPUIDs: h.GPUs, KeysAdded: h.HostKeys, Volumes: h.Volumes, NoContainer: h.Container.None}
}

// diskRecord is a record as written: version 2 and version 1's fields.
type diskRecord struct {
	record
	recordV1
}

// held reads a version 1 record's holdings in the version 2 shape.
func (v recordV1) held() held {
	return held{
		Container: heldContainer{Name: v.ContainerName, ID: v.ContainerID, Ports: v.Ports, None: v.NoContainer},
		GPUs:      v.GPUIDs, HostKeys: v.KeysAdded, Volumes: v.Volumes,
	}
}

// records stores one JSON file per task; the file name is the escaped task
// id, so even an unreadable record still names its task.
//
// A record the home's filesystem refuses (full, even after the reserve)
// is spilled: written to spill, a directory on another filesystem (by
// default under /run, a tmpfs: memory, which a job filling the disk does
// not fill). It waits there for the next write that lands, or for the next
// start, which takes the newer of the two and writes it home. So a state
// change the shim could not persist survives a restart (not a reboot:
// /run is emptied, and so is every container).
type records struct {
	dir     string
	spill   string   // "" none
	reserve *reserve // nil: none
	now     func() time.Time
}

func (r records) path(id string) string {
	return filepath.Join(r.dir, url.PathEscape(id)+".json")
}

func (r records) spillPath(id string) string {
	return filepath.Join(r.spill, url.PathEscape(id)+".json")
}

// DefaultSpillDir is where the records of a shim home wait when that home
// cannot take them: /run/tandem-shim/<hash of the home's absolute path>,
// so two shims on one host never share it.
func DefaultSpillDir(home string) string {
	if abs, err := filepath.Abs(home); err == nil {
		home = abs
	}
	sum := sha256.Sum256([]byte(home))
	return filepath.Join("/run/tandem-shim", hex.EncodeToString(sum[:8]))
}

// save writes rec atomically (atomicfile: temp file, fsync, rename).
func (r records) save(rec record) error {
	rec.Version = recordVersion
	rec.Config.RegistryPassword = ""
	if r.now != nil {
		rec.SavedAt = r.now().UTC()
	}
	b, err := json.Marshal(diskRecord{rec, v1Of(rec.Held)})
	if err != nil {
		return fmt.Errorf("encode task record: %w", err)
	}
	if err := os.MkdirAll(r.dir, 0o700); err != nil {
		return fmt.Errorf("task records: %w", err)
	}
	// No fsync of the directory: the rename is atomic for a crashed or
	// killed shim, and after a power cut the previous record (older, never
	// torn) is what recovery reads. It halves the fsyncs on the start path.
	write := func() error {
		return atomicfile.WriteBytes(r.path(rec.Config.ID), b, atomicfile.Options{Perm: 0o600, UID: -1})
	}
	err = write()
	if err != nil && noSpace(err) && r.reserve.release() {
		err = write()
	}
	if err != nil {
		if serr := r.spillWrite(rec.Config.ID, b); serr != nil {
			err = errors.Join(err, serr)
		}
		return fmt.Errorf("task record %s: %w", rec.Config.ID, err)
	}
	if r.spill != "" {
		_ = os.Remove(r.spillPath(rec.Config.ID)) // written home: nothing waits
	}
	r.reserve.take()
	return nil
}

// spillWrite keeps a record the home refused where a restart finds it.
func (r records) spillWrite(id string, b []byte) error {
	if r.spill == "" {
		return nil
	}
	if err := os.MkdirAll(r.spill, 0o700); err != nil {
		return fmt.Errorf("spill task record: %w", err)
	}
	if err := atomicfile.WriteBytes(r.spillPath(id), b, atomicfile.Options{Perm: 0o600, UID: -1}); err != nil {
		return fmt.Errorf("spill task record: %w", err)
	}
	return nil
}

func (r records) remove(id string) error {
	if r.spill != "" {
		_ = os.Remove(r.spillPath(id))
	}
	if err := os.Remove(r.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove task record: %w", err)
	}
	return nil
}

// loaded is a record read back, or the reason it could not be.
type loaded struct {
	id  string
	rec record
	err error
}

// load reads every record; unreadable ones come back with their error. A
// spilled record newer than the home's (or without one) stands in for it
// and is written home now; the home's wins otherwise and the spill goes.
func (r records) load() ([]loaded, error) {
	out, err := readRecords(r.dir)
	if err != nil {
		return nil, err
	}
	if r.spill == "" {
		return out, nil
	}
	spilled, err := readRecords(r.spill)
	if err != nil || len(spilled) == 0 {
		return out, nil // what the home holds is still right, if older
	}
	at := make(map[string]int, len(out))
	for i, l := range out {
		at[l.id] = i
	}
	for _, s := range spilled {
		i, ok := at[s.id]
		switch {
		case s.err != nil:
			_ = os.Remove(r.spillPath(s.id))
			continue
		case ok && out[i].err == nil && !s.rec.SavedAt.After(out[i].rec.SavedAt):
			_ = os.Remove(r.spillPath(s.id)) // the home's is as new
			continue
		case ok:
			out[i] = s
		default:
			out = append(out, s)
		}
		_ = r.save(s.rec) // home now if it has room (and the spill goes); else it waits on
	}
	return out, nil
}

// readRecords reads the records in dir.
func readRecords(dir string) ([]loaded, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("task records: %w", err)
	}
	var out []loaded
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") {
			if strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-") {
				_ = os.Remove(filepath.Join(dir, name)) // a write cut short (atomicfile.TempPattern)
			}
			continue
		}
		id, err := url.PathUnescape(strings.TrimSuffix(name, ".json"))
		if err != nil {
			continue
		}
		l := loaded{id: id}
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err == nil {
			err = json.Unmarshal(b, &l.rec)
		}
		if err == nil && l.rec.Version < 2 {
			var v1 recordV1
			if err = json.Unmarshal(b, &v1); err == nil {
				l.rec.Held = v1.held()
			}
		}
		switch {
		case err != nil:
			l.err = err
		case l.rec.Config.ID != id:
			l.err = fmt.Errorf("record names task %q", l.rec.Config.ID)
		case !l.rec.Status.Valid():
			l.err = fmt.Errorf("unknown status %q", l.rec.Status)
		}
		out = append(out, l)
	}
	return out, nil
}

// hashPassword returns "sha256$<salt>$<digest>" for a non-empty password.
func hashPassword(pw string) string {
	if pw == "" {
		return ""
	}
	salt := make([]byte, 16)
	_, _ = rand.Read(salt)
	sum := sha256.Sum256(append(salt, pw...))
	return "sha256$" + hex.EncodeToString(salt) + "$" + hex.EncodeToString(sum[:])
}

// passwordMatches checks pw against a hashPassword result.
func passwordMatches(hash, pw string) bool {
	parts := strings.Split(hash, "$")
	if len(parts) != 3 || parts[0] != "sha256" {
		return false
	}
	salt, err1 := hex.DecodeString(parts[1])
	want, err2 := hex.DecodeString(parts[2])
	if err1 != nil || err2 != nil {
		return false
	}
	sum := sha256.Sum256(append(salt, pw...))
	return subtle.ConstantTimeCompare(sum[:], want) == 1
}
