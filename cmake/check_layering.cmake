# Checks that every #include "..." in the engine points along a declared
# arrow. Run by ctest (test "layering"):
#   cmake -DRULES=<build>/layering_rules.cmake -DROOT=<source root> -P check_layering.cmake
# RULES is written at configure time by the zs_layer() calls in the top
# CMakeLists.txt: for each layer its folder and the layers it may use, and
# the known exceptions ("from>to" pairs, each to be removed).
# Fails, listing them, on an include of a layer that is neither the file's
# own, nor declared, nor an exception; and on an exception nothing needs.
cmake_minimum_required(VERSION 3.20)
if(NOT RULES OR NOT ROOT)
  message(FATAL_ERROR "usage: cmake -DRULES=... -DROOT=... -P check_layering.cmake")
endif()
include(${RULES})
# Sub-layers (zs_sublayer) own their folders too; layer_of picks the
# longest folder that holds a path.
set(ZS_OWNERS ${ZS_LAYERS} ${ZS_SUBLAYERS})

# The layer that owns a path relative to the root ("" for none of ours).
function(layer_of path out)
  set(best "")
  set(best_len 0)
  foreach(l IN LISTS ZS_OWNERS)
    set(f "${ZS_LAYER_FOLDER_${l}}")
    string(LENGTH "${f}" n)
    string(SUBSTRING "${path}/" 0 ${n} head)
    if(head STREQUAL f AND n GREATER best_len)
      string(SUBSTRING "${path}/" ${n} 1 next)
      if(next STREQUAL "/")
        set(best ${l})
        set(best_len ${n})
      endif()
    endif()
  endforeach()
  if(best STREQUAL "" AND path MATCHES "^zeroshard/")
    set(best public)  # include/zeroshard/, the public header
  endif()
  set(${out} "${best}" PARENT_SCOPE)
endfunction()

set(violations "")
set(used_exceptions "")
set(files "")
foreach(l IN LISTS ZS_OWNERS)
  file(GLOB_RECURSE found "${ROOT}/${ZS_LAYER_FOLDER_${l}}/*.h" "${ROOT}/${ZS_LAYER_FOLDER_${l}}/*.cpp"
       "${ROOT}/${ZS_LAYER_FOLDER_${l}}/*.cu" "${ROOT}/${ZS_LAYER_FOLDER_${l}}/*.cuh")
  list(APPEND files ${found})
endforeach()
list(REMOVE_DUPLICATES files)
list(SORT files)

foreach(file IN LISTS files)
  file(RELATIVE_PATH rel "${ROOT}" "${file}")
  get_filename_component(dir "${rel}" DIRECTORY)
  layer_of("${rel}" from)
  file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*$" "\\1" inc "${line}")
    if(EXISTS "${ROOT}/${dir}/${inc}" AND NOT inc MATCHES "/")
      set(target_path "${dir}/${inc}")  # beside the file
    else()
      set(target_path "${inc}")
    endif()
    layer_of("${target_path}" to)
    if(to STREQUAL "")
      list(APPEND violations "${rel} includes \"${inc}\", which is in no layer")
      continue()
    endif()
    if(to STREQUAL from OR to IN_LIST ZS_LAYER_USES_${from})
      continue()
    endif()
    # A sub-layer is open to its parent's files and to the parent's users.
    set(parent "${ZS_LAYER_PARENT_${to}}")
    if(NOT parent STREQUAL "" AND (parent STREQUAL from OR parent IN_LIST ZS_LAYER_USES_${from}))
      continue()
    endif()
    if("${from}>${to}" IN_LIST ZS_LAYER_EXCEPTIONS)
      list(APPEND used_exceptions "${from}>${to}")
      continue()
    endif()
    list(APPEND violations
      "${rel} includes ${target_path}: layer ${from} may use only [${ZS_LAYER_USES_${from}}], not ${to}")
  endforeach()
endforeach()

foreach(e IN LISTS ZS_LAYER_EXCEPTIONS)
  if(NOT e IN_LIST used_exceptions)
    list(APPEND violations "exception ${e} is no longer needed: remove it from ZS_LAYER_EXCEPTIONS")
  endif()
endforeach()

list(LENGTH files nfiles)
if(violations)
  list(JOIN violations "\n  " text)
  message(FATAL_ERROR "layering: ${nfiles} files checked, these includes point the wrong way:\n  ${text}")
endif()
message(STATUS "layering: ${nfiles} files, every include along a declared arrow")
