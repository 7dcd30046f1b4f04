//go:build !linux

package sockdiag

import (
	"errors"
	"net"
)

var errUnsupported = errors.New("socket lookups need Linux")

// Lookup finds client sockets (Linux only).
type Lookup struct{}

// Open prepares a Lookup.
func Open(string) *Lookup { return &Lookup{} }

// Close releases it.
func (l *Lookup) Close() {}

// Find is unsupported here.
func (l *Lookup) Find(_, _ *net.TCPAddr) (uint64, uint32, error) { return 0, 0, errUnsupported }
