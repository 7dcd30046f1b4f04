package imagegc

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/tandem-run/tandem/common/atomicfile"
)

// Ledger is the shim's own record of the images it put into Docker itself
// (the fast pull's loads: Docker gives such an image no RepoDigests), one
// image ID per line. With RepoDigests (a registry holds the image) it is
// what makes an image the collector's to remove: one built or loaded on
// the host by anyone else may exist nowhere else, and is never removed.
type Ledger struct {
	Path string

	mu sync.Mutex
}

// MaxLedger bounds the ledger: the oldest IDs go first.
const MaxLedger = 4096

// Add records id (sha256:...), once.
func (l *Ledger) Add(id string) error {
	if !strings.HasPrefix(id, "sha256:") || strings.ContainsAny(id, "\n\r") {
		return fmt.Errorf("image ledger: %q is not an image ID", id)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	ids, err := l.read()
	if err != nil {
		return err
	}
	if slices.Contains(ids, id) {
		return nil
	}
	ids = append(ids, id)
	if len(ids) > MaxLedger {
		ids = ids[len(ids)-MaxLedger:]
	}
	var b bytes.Buffer
	for _, x := range ids {
		b.WriteString(x + "\n")
	}
	if err := atomicfile.WriteBytes(l.Path, b.Bytes(), atomicfile.Options{Perm: 0o600, UID: -1}); err != nil {
		return fmt.Errorf("image ledger: %w", err)
	}
	return nil
}

// IDs is the set of recorded image IDs; a missing ledger is empty.
func (l *Ledger) IDs() (map[string]bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ids, err := l.read()
	if err != nil {
		return nil, err
	}
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return set, nil
}

func (l *Ledger) read() ([]string, error) {
	f, err := os.Open(l.Path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("image ledger: %w", err)
	}
	defer f.Close()
	var ids []string
	sc := bufio.NewScanner(f)
	for sc.Scan() && len(ids) < 2*MaxLedger {
		if id := strings.TrimSpace(sc.Text()); strings.HasPrefix(id, "sha256:") {
			ids = append(ids, id)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("image ledger: %w", err)
	}
	return ids, nil
}
