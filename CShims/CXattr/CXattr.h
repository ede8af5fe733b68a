// Extended attribute calls Glibc's Swift overlay does not import. Kept apart
// from CFuse so the client library does not link libfuse.
#include <sys/types.h>
#include <sys/xattr.h>
