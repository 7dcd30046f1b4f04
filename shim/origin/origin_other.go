//go:build !linux

package origin

import (
	"errors"
	"net"
)

var errUnsupported = errors.New("origin checks need Linux procfs")

type inodeLookup struct{}

func (c Checker) inodeLookup() *inodeLookup { return &inodeLookup{} }
func (l *inodeLookup) close()               {}
func (l *inodeLookup) inode(_, _ *net.TCPAddr) (uint64, uint32, error) {
	return 0, 0, errUnsupported
}
func (c Checker) socketOwners(map[uint64]struct{}) (map[uint64]owner, error) {
	return nil, errUnsupported
}
func (c Checker) sameMountNamespace(int) (bool, error) { return false, errUnsupported }
