// libfuse3's low-level API for Swift, with the few helpers its C macros
// need. The Linux calls and constants Swift's Glibc module lacks are in
// CLinux (compiled with _GNU_SOURCE); this header defines no feature macro,
// since Swift imports it next to Glibc.
#ifndef VANISH_CFUSE_H
#define VANISH_CFUSE_H

#define FUSE_USE_VERSION 314

#include <stddef.h>
#include <fuse_lowlevel.h>

/// The reply that lets libfuse splice file data straight from `fd` to the
/// kernel without copying it through user space.
static inline int vanish_reply_fd_data(fuse_req_t req, int fd, off_t offset, size_t size) {
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    buf.buf[0].fd = fd;
    buf.buf[0].pos = offset;
    return fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

/// Copies the request's buffer (memory or pipe) into `fd` at `offset`;
/// returns bytes written or -errno.
static inline ssize_t vanish_write_buf_to_fd(struct fuse_bufvec *in, int fd, off_t offset) {
    struct fuse_bufvec out = FUSE_BUFVEC_INIT(fuse_buf_size(in));
    out.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    out.buf[0].fd = fd;
    out.buf[0].pos = offset;
    return fuse_buf_copy(&out, in, (enum fuse_buf_copy_flags)0);
}

/// Kept behind a function because libfuse >= 3.17 turns fuse_session_new into
/// a macro.
static inline struct fuse_session *vanish_session_new(struct fuse_args *args,
                                                      const struct fuse_lowlevel_ops *ops,
                                                      void *userdata) {
    return fuse_session_new(args, ops, sizeof(*ops), userdata);
}

#endif
