# CPack pre-build script (CPACK_PRE_BUILD_SCRIPTS): runs after CPack has
# staged each package's files and before it builds the .debs.
#
# 1. The packages are only right for the prefix the systemd unit assumes
#    (ExecStart=/usr/sbin/bufbrokerd) and with the config in /etc: refuse
#    anything else.
# 2. Every file the bufbroker package installs under /etc is a conffile, as
#    debhelper would mark it: dpkg then keeps the administrator's edits across
#    upgrades and removes the file only on purge. The list is written from
#    what was staged, so it is right whether or not a config file is
#    installed at all.
# 3. Man pages are gzip-compressed, as Debian policy asks.
#
# Set by CMakeLists.txt through CPackConfig.cmake: CPACK_BB_INSTALL_PREFIX,
# CPACK_BB_CONFFILES (the file to write), CPACK_BB_RUNTIME_GROUP (the staging
# folder of the bufbroker package).

if(NOT CPACK_BB_INSTALL_PREFIX STREQUAL "/usr")
  message(FATAL_ERROR
    "bufbroker: packages must be built from a tree configured with "
    "-DCMAKE_INSTALL_PREFIX=/usr (this one has '${CPACK_BB_INSTALL_PREFIX}'): "
    "the systemd unit runs /usr/sbin/bufbrokerd")
endif()

set(_bb_stage "${CPACK_TEMPORARY_DIRECTORY}/${CPACK_BB_RUNTIME_GROUP}")
if(NOT IS_DIRECTORY "${_bb_stage}")
  message(FATAL_ERROR "bufbroker: no staged files in ${_bb_stage}")
endif()
# A relative CMAKE_INSTALL_SYSCONFDIR ("etc", the default) puts the config
# under the prefix: /usr/etc, where nothing looks for it.
if(EXISTS "${_bb_stage}/usr/etc")
  message(FATAL_ERROR
    "bufbroker: the package would install into /usr/etc: configure the "
    "packaging build with -DCMAKE_INSTALL_SYSCONFDIR=/etc (as debhelper does)")
endif()
file(GLOB_RECURSE _bb_etc LIST_DIRECTORIES false RELATIVE "${_bb_stage}" "${_bb_stage}/etc/*")
list(SORT _bb_etc)
set(_bb_text "")
foreach(f IN LISTS _bb_etc)
  string(APPEND _bb_text "/${f}\n")
endforeach()
file(WRITE "${CPACK_BB_CONFFILES}" "${_bb_text}")

# 3. gzip -9n: no name or time stamp inside, so the package is reproducible.
file(GLOB_RECURSE _bb_man LIST_DIRECTORIES false "${_bb_stage}/usr/share/man/*")
foreach(f IN LISTS _bb_man)
  if(NOT f MATCHES "\\.gz$" AND NOT IS_SYMLINK "${f}")
    execute_process(COMMAND gzip -9n "${f}" RESULT_VARIABLE _bb_rc)
    if(NOT _bb_rc EQUAL 0)
      message(FATAL_ERROR "bufbroker: gzip ${f} failed")
    endif()
  endif()
endforeach()
